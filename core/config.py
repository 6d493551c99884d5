"""Typed, validated configuration for VoxRay (pydantic, `extra="forbid"`).

One `VoxRayConfig` drives `voxray serve`, the Serve YAML and the k8s manifests; each component
receives only its own sub-config (`ModelConfig`, `CacheConfig`, `SchedulerConfig`, `DetokConfig`).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Which model family to run and where its weights live."""

    name: str = Field("orpheus-tiny", description="Registry name of the model (see `voxray models`).")
    checkpoint_dir: Path | str | None = Field(
        None,
        description="LM checkpoint: a local directory or a Hugging Face repo id (e.g. canopylabs/orpheus-3b-0.1-ft) "
        "resolved from the local HF cache, never downloaded; None = preset weights.",
    )
    codec_dir: Path | str | None = Field(
        None,
        description="Codec checkpoint: a local directory or a repo id (e.g. hubertsiuzdak/snac_24khz) in the local HF "
        "cache; None = the family's published codec for a checkpoint model (see `voxray models`), preset weights "
        "for a -tiny model.",
    )
    speech_tokenizer_dir: Path | str | None = Field(
        None,
        description="Speech tokenizer of a family that reads the user's audio as tokens (glm4-voice: "
        "THUDM/glm-4-voice-tokenizer): a local directory or a repo id in the local HF cache; None = the family's "
        "published one for a checkpoint model, preset weights for a -tiny model.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("cpu", description="torch device for this stage, e.g. 'cpu' or 'cuda'.")
    seed: int = Field(0, description="Seed for preset random weights and unseeded sampling.")
    torch_threads: int = Field(0, ge=0, le=256, description="CPU threads for torch ops; 0 = torch's default.")


class CacheConfig(_Strict):
    """KV cache of the LLM stage, allocated once. `slot`: `num_slots` rows of `max_seq_len` tokens
    each. `paged`: a pool of `num_blocks` blocks of `block_size` tokens shared by the `num_slots`
    sequences through a block table; a sequence holds blocks for the positions it can reach (prompt +
    max_tokens), so `max_seq_len` bounds one sequence, not the memory."""

    num_slots: int = Field(32, ge=1, le=4096, description="Concurrent sequences the KV cache holds.")
    max_seq_len: int = Field(2048, ge=16, le=131072, description="Tokens per sequence (prompt + output).")
    layout: Literal["slot", "paged"] = Field(
        "slot",
        description="slot: num_slots x max_seq_len preallocated; paged: a block pool of num_blocks x block_size "
        "tokens, each sequence reserving the blocks its prompt + max_tokens need at admission.",
    )
    keep_prompts: bool = Field(
        True,
        description="Families whose prompt ids are their content (GLM-4-Voice, Step-Audio 2): an ended request's "
        "prompt KV stays in its slot (paged: its prompt's blocks) until a request needs them, and a request whose "
        "prompt starts the same (a conversation's next turn) prefills only the rest.",
    )
    block_size: int = Field(16, ge=1, le=4096, description="Paged layout: tokens per KV block.")
    num_blocks: int | None = Field(
        None,
        ge=1,
        description="Paged layout: KV blocks in the pool (the KV budget: blocks x block_size x the model's bytes "
        "per token); None = as many as num_slots full-length sequences need (the slot layout's memory).",
    )

    @property
    def max_blocks_per_slot(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    @property
    def total_blocks(self) -> int:
        """The paged pool's blocks (without the scratch block)."""
        return self.num_blocks if self.num_blocks is not None else self.num_slots * self.max_blocks_per_slot

    @model_validator(mode="after")
    def _pool_holds_a_sequence(self) -> CacheConfig:
        if self.layout == "paged" and self.total_blocks < self.max_blocks_per_slot:
            raise ValueError("cache.num_blocks must hold one max_seq_len sequence (max_seq_len / block_size blocks)")
        return self


class SchedulerConfig(_Strict):
    """LLM-stage batch selection and step execution."""

    policy: Literal["fcfs", "streaming", "throughput"] = "fcfs"
    max_batch_size: int = Field(32, ge=1, le=4096, description="Rows per decode step.")
    prefill_token_budget: int = Field(256, ge=1, description="Prompt tokens prefilled per step (chunked).")
    startup_concurrency: int = Field(4, ge=1, description="Streams allowed in the startup phase at once.")
    align_starts: bool = Field(
        True,
        description="Time a new request's first token to the head phase most running rows are in (models whose "
        "head cost depends on the row's position in a frame, e.g. Orpheus' slot heads): rows in one phase share "
        "one head matmul. Delays a start by fewer steps than a frame has.",
    )
    async_steps: bool = Field(
        False, description="Run each forward on a worker thread while the next step is planned (batch, sampling)."
    )
    cuda_graphs: bool = Field(
        True,
        description="Replay the decode forward as CUDA graphs on a CUDA device (elsewhere it runs eagerly); "
        "false = eager on CUDA too.",
    )
    cuda_graph_batch_sizes: tuple[int, ...] = Field(
        (),
        description="Decode batch sizes captured as CUDA graphs (a batch pads to the next one; prompt tokens folded "
        "into a decode step count as rows); empty = derived: up to max_batch_size + min(prefill_token_budget, 512), "
        "1, 2, 4, 8, then steps of 8 to 32, 16 to 128, 32 to 256, 64 beyond.",
    )


class DetokConfig(_Strict):
    """Detokenizer chunk schedule and batching.

    `auto`: the family's own schedule where its detokenizer needs one (cosyvoice2 / chatterbox: S3Gen
    streams whole 25-token attention chunks, 3 look-ahead tokens, the stream from token 0 as history),
    else `wide`.
    `reference`: Orpheus' own semantics (1 frame per chunk, 1 frame left and 2 right context).
    `wide`: bigger chunks with fixed left/right context, so each frame is decoded fewer times.
    A schedule the family's detokenizer cannot stream is refused, naming the field.
    """

    schedule: Literal["auto", "reference", "wide"] = "auto"
    first_chunk_frames: int = Field(2, ge=1, description="Frames in the first chunk (wide schedule).")
    chunk_frames: int = Field(8, ge=1, description="Frames in later chunks (wide schedule).")
    left_context_frames: int = Field(3, ge=0, description="Frames of left context per window (wide).")
    right_context_frames: int = Field(3, ge=0, description="Frames of right context per window (wide).")
    adaptive: bool = Field(
        True,
        description="Wide schedule: chunk sizes double from first_chunk_frames up to chunk_frames, bounded by slack.",
    )
    throughput_chunk_frames: int = Field(
        16, ge=1, description="Throughput mode (wide schedule): frames per chunk, first chunk included."
    )
    max_batch_chunks: int = Field(32, ge=1, description="Chunks decoded in one detokenizer forward.")
    device: str = Field("cpu", description="torch device of the detokenizer stage.")
    async_steps: bool = Field(
        False, description="Decode each batch on a worker thread while the next one is picked and the last one is cut."
    )
    cuda_graphs: bool = Field(
        True,
        description="Replay the codec over full-length windows as CUDA graphs on a CUDA device (stateless codecs, "
        "wide schedule); false = eager on CUDA too.",
    )
    cuda_graph_batch_sizes: tuple[int, ...] = Field(
        (),
        description="Chunk-batch sizes captured as CUDA graphs for full-length windows; empty = derived from "
        "max_batch_chunks (1, 2, 4, 8, then steps of 8 to 32, 16 beyond).",
    )
    flow_window_frames: int = Field(
        0,
        ge=0,
        description="Flow detokenizers (S3Gen: cosyvoice2, chatterbox, step-audio2): mel frames before each "
        "attention chunk that the estimator reads, besides the first flow_sink_frames; a stream's estimator "
        "memory then stays fixed (4.6 MB a frame at the published shapes, fp32) and the audio differs from "
        "the exact decoding (offline decoding reads the same frames). 0 = every earlier frame (exact).",
    )
    flow_sink_frames: int = Field(
        0, ge=0, description="With flow_window_frames: the stream's first mel frames the estimator always reads."
    )


class EngineConfig(_Strict):
    """Everything the two in-process engines need."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    detok: DetokConfig = DetokConfig()
    warm_up: bool = Field(
        True,
        description="Serve replicas: before serving, run each engine once at its largest shapes (every batch row, "
        "the longest prompt; every chunk of a detokenizer batch at the longest window), so memory reaches its "
        "high water at start, not under traffic.",
    )

    @model_validator(mode="after")
    def _batch_fits_cache(self) -> EngineConfig:
        if self.scheduler.max_batch_size > self.cache.num_slots:
            raise ValueError("scheduler.max_batch_size must be <= cache.num_slots")
        return self


def load_engine_config(path: Path) -> EngineConfig:
    """Read an EngineConfig from a YAML file."""
    return EngineConfig.model_validate(yaml.safe_load(Path(path).read_text()) or {})


class SLOScalingConfig(_Strict):
    """The SLO-driven policy (`core.autoscaling`): each replica's pressure (1 = at its SLO limit)
    against a hysteresis band, a wish held for `sustain_s`, cool-downs. Used when a stage's
    `autoscaling_policy` is `slo`."""

    ttfa_target_s: float = Field(1.0, gt=0, description="LLM: predicted TTFA of one more stream that counts as full.")
    stream_use_target: float = Field(
        0.85, gt=0, le=1, description="LLM: share of the streams a replica admits (KV slots, measured pace) in use "
        "that counts as full.",
    )  # fmt: skip
    busy_share_target: float = Field(0.8, gt=0, description="Detok: decode busy share that counts as full.")
    slack_target_s: float = Field(
        0.5, gt=0, description="Detok: time to spare before the streams' playback deadlines under which it is full."
    )
    scale_up_pressure: float = Field(0.9, gt=0, description="Mean pressure above which one more replica is added.")
    scale_down_pressure: float = Field(
        0.45, gt=0, description="One replica leaves when the others' mean pressure would stay below this."
    )
    sustain_s: float = Field(3.0, ge=0, description="How long a wish to scale must hold before it is acted on.")
    up_cooldown_s: float = Field(10.0, ge=0, description="No scale-up this long after any scaling.")
    down_cooldown_s: float = Field(30.0, ge=0, description="No scale-down this long after any scaling.")
    look_back_s: float = Field(
        15.0, gt=10, description="Serve averages each replica's stats over this window (its look_back_period_s; "
        "Serve wants it above the replicas' 10 s metrics push interval).",
    )  # fmt: skip

    @model_validator(mode="after")
    def _band(self) -> SLOScalingConfig:
        if self.scale_down_pressure >= self.scale_up_pressure:
            raise ValueError("slo.scale_down_pressure must be below slo.scale_up_pressure (the hysteresis band)")
        return self


class StageDeploymentConfig(_Strict):
    """Replica count / autoscaling and resources of one Serve deployment."""

    num_replicas: int = Field(1, ge=1, le=1024, description="Replicas when autoscaling is off.")
    autoscaling: bool = Field(False, description="Scale between min_replicas and max_replicas.")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)
    autoscaling_policy: Literal["ongoing_requests", "slo"] = Field(
        "ongoing_requests", description="ongoing_requests: Serve's default (target_ongoing_requests); slo: the "
        "stage's SLO signals (LLM: predicted TTFA and stream use; detok: busy share and deadline slack), `slo`.",
    )  # fmt: skip
    slo: SLOScalingConfig = SLOScalingConfig()
    num_cpus: float = Field(0.5, ge=0, description="Logical CPUs per replica (fractions allowed).")
    num_gpus: float = Field(0.0, ge=0, description="1 per replica on GPU clusters (one accelerator each).")
    max_ongoing_requests: int = Field(256, ge=1, description="Serve-level cap; admission is ours.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources (node steering).")
    health_check_period_s: float = Field(
        2.0, gt=0, le=600, description="How often Serve checks each replica; a lost replica is replaced after the "
        "next check fails (Serve's default: 10 s). Streams do not wait for it: they fail over at once."
    )  # fmt: skip

    @model_validator(mode="after")
    def _bounds(self) -> StageDeploymentConfig:
        if self.autoscaling and self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class AdmissionConfig(_Strict):
    """Router-side admission: admit, queue briefly, or reject with a retry hint."""

    max_streams_per_replica: int = Field(
        16,
        ge=1,
        description="Most streams one LLM replica serves at once (its KV cap; the measured pace may admit fewer).",
    )
    real_time_margin: float = Field(
        0.85,
        gt=0,
        le=1,
        description="Share of the streams the replica's measured steps keep at real time that it admits; "
        "the rest is headroom for new streams' first chunks.",
    )
    policy: Literal["predictive", "fixed_cap"] = Field(
        "predictive",
        description="predictive: admit while the predicted first audio meets the request's TTFA deadline and the "
        "stages' measured pace keeps every stream at real time (under max_streams_per_replica); fixed_cap: count "
        "streams against max_streams_per_replica only (the admission before it: for side-by-side benchmarks).",
    )
    max_queued_per_replica: int = Field(8, ge=0, description="Requests waiting for a slot on one LLM replica.")
    max_starting_per_replica: int = Field(
        4, ge=1,
        description="Most streams one LLM replica starts at once (predictive policy; a busy replica fewer: a starting "
        "stream weighs two playing ones): a stream is starting until it has sent its second chunk, and one more waits "
        "(queued, or refused when it could not start by its TTFA deadline): streams started together hold one small "
        "chunk each while the others' first chunks take the steps.",
    )  # fmt: skip
    credible_ttfa_factor: float = Field(
        3.0, ge=0,
        description="A request is refused for its TTFA deadline (RESOURCE_EXHAUSTED, or DEADLINE_EXCEEDED for a "
        "gRPC deadline) only on a predicted first audio at most this many times the replica's recent measured p90 "
        "(arrival to first chunk, queue included); a prediction beyond it runs on a transient (a failover's resumes, "
        "a replacement's first steps), so the request is admitted or queued instead. 0: every prediction refuses.",
    )  # fmt: skip
    default_ttfa_deadline_s: float = Field(5.0, gt=0, description="Deadline when the request names none.")
    retry_after_s: float = Field(1.0, gt=0, description="Hint sent with RESOURCE_EXHAUSTED / 429.")
    unavailable_retry_after_s: float = Field(
        5.0, gt=0, description="Hint sent with UNAVAILABLE / 503 when no LLM replica is alive (Serve is starting one)."
    )


class AuthConfig(_Strict):
    """API keys and per-key quotas, checked by the Router on both protocols (HTTP `Authorization:
    Bearer <key>`, gRPC `authorization: Bearer <key>` metadata)."""

    api_keys_file: Path | None = Field(
        None,
        description="File of the accepted keys' sha256 hex digests, one per line as `<sha256-hex> [name]` ('#' "
        "comments), e.g. a k8s Secret mounted as a file; re-read when it changes. None = open: every client is "
        "served without a key (the loopback embedded default; the Router logs it at start; beyond loopback only "
        "with allow_open).",
    )
    allow_open: bool = Field(
        False,
        description="Serve every client without a key while listening beyond loopback (http_host / grpc_host not "
        "127.0.0.1 / ::1 / localhost). Off: such a config without api_keys_file is refused, so an exposed server "
        "is open only by this explicit setting (the k8s dev-cpu config sets it; the prod configs name a keys file).",
    )
    max_streams_per_key: int = Field(8, ge=1, description="Concurrent synthesis streams one key holds (per Router).")
    requests_per_s_per_key: float = Field(
        10.0, gt=0, le=1e6, description="Sustained requests per second one key may make (token bucket, per Router)."
    )
    burst_per_key: int = Field(20, ge=1, description="Requests one key may make at once above its sustained rate.")
    reload_interval_s: float = Field(5.0, gt=0, description="How often the Router checks the keys file for changes.")


SERVE_GRACE_MARGIN_S = 5.0  # Serve's graceful timeout beyond the drain grace (a last chunk, replica exit)
GRACEFUL_WAIT_LOOP_S = 1.0  # how often a stopping Serve replica checks whether its requests are done


class DrainConfig(_Strict):
    """Graceful stop: SIGTERM to `voxray serve`, or `voxray drain` (the k8s preStop hook)."""

    grace_s: float = Field(
        25.0, gt=0, le=3600,
        description="Streams playing at the stop may finish within this; the rest end UNAVAILABLE with a retry hint. "
        "The k8s terminationGracePeriodSeconds must exceed it.",
    )  # fmt: skip
    retry_after_s: float = Field(1.0, gt=0, description="Hint sent with UNAVAILABLE / 503 while draining.")

    @property
    def serve_graceful_timeout_s(self) -> float:
        """Serve's graceful_shutdown_timeout_s for every deployment: the drain's streams end by
        `grace_s` (at their next chunk), so Serve never has to kill a replica mid-stream."""
        return self.grace_s + SERVE_GRACE_MARGIN_S


class RebalanceConfig(_Strict):
    """Rebalancing active streams between LLM replicas (`router.rebalance`): when one replica runs
    `min_imbalance` more streams than another (say the streams that failed over onto a survivor
    while Serve's replacement idles), each Router asks the busy one to hand half the gap over,
    KV included, the way a leaving replica hands off all of its streams."""

    enabled: bool = Field(True, description="Move streams from the busiest LLM replica to the least busy one.")
    min_imbalance: int = Field(
        2, ge=2, le=4096, description="Active streams the busiest replica must run beyond the least busy one before "
        "any moves (half the gap moves; a gap of 1 would only swap the imbalance around)."
    )  # fmt: skip
    min_busy_share: float = Field(
        0.75, ge=0, le=1, description="The busiest replica must run at least this share of "
        "admission.max_streams_per_replica before any moves: below it, it has room, and a move would only cost the "
        "moved streams a hand-off (streams ending elsewhere would otherwise send streams back and forth)."
    )  # fmt: skip
    period_s: float = Field(1.0, gt=0, le=3600, description="How often each Router compares the replicas' loads.")
    cooldown_s: float = Field(
        3.0, ge=0, le=3600, description="After asking for a move, wait this long before planning the next one (the "
        "load reports catch up with the move meanwhile)."
    )  # fmt: skip
    pass_over_s: float = Field(
        2.0, ge=0, le=3600, description="A replica that handed streams off to rebalance is ranked last for this "
        "long, so the moved streams (and new ones) land on the others; a leaving replica is passed over for good."
    )  # fmt: skip


class MigrationConfig(_Strict):
    """How a stream continues on another LLM replica: a moved one's KV (drain, move-out, rebalance), a
    resumed one's wait for a replica to resume on."""

    kv_transport: Literal["auto", "gloo", "object_store"] = Field(
        "auto",
        description="auto: between nodes over Ray Direct Transport's gloo, point to point between two endpoints (one "
        "on each node) driven by the LLM stage's KV courier (a Serve deployment actor, there when the stage may run "
        "more than one replica); within a node from the object store (shared memory: 8-30x faster than any copy, "
        "BENCHMARKS.md). gloo: the courier for every move, within a node too. object_store: never the courier. A "
        "courier delivery that fails falls back to the object store, so a move never prefills for the transport's "
        "sake. nccl is not offered: the KV leaves the GPU when it is taken, and its endpoints would each need a GPU.",
    )  # fmt: skip
    delivery_timeout_s: float = Field(
        30.0, gt=0, le=600, description="Longest wait for a gloo delivery (the first one between two nodes forms "
        "their group: seconds on a loaded CPU box) before reading the object store instead."
    )  # fmt: skip
    replacement_wait_s: float = Field(
        30.0, ge=0, le=600, description="Longest a stream whose LLM replica was lost waits for Serve's replacement "
        "when no other LLM replica is left (one replica, as the embedded default runs: a replacement is up in ~6-20 "
        "s), then resumes there from its last checkpoint, late but complete; over it, it ends with UNAVAILABLE and a "
        "retry hint. 0: end it at once. New requests meanwhile answer UNAVAILABLE at once either way.",
    )  # fmt: skip


CHECK_FILES = "check_files"  # validation context key: False when rendering a config for other machines (k8s)


class TlsConfig(_Strict):
    """TLS on both public protocols: Serve's HTTP proxy and the Router's gRPC server. Both paths or
    neither; they must exist where the config is served (not checked when rendering for k8s)."""

    cert_file: Path | None = Field(None, description="PEM certificate chain (e.g. a k8s TLS Secret's tls.crt).")
    key_file: Path | None = Field(None, description="PEM private key of the certificate (tls.key).")
    http_proxy: bool = Field(
        True,
        description="Serve's HTTP proxy uses the certificate too. False where a gateway terminates HTTPS, e.g. "
        "on k8s: KubeRay health-checks the proxy over plain HTTP on its `serve` port.",
    )

    @model_validator(mode="after")
    def _pair(self, info: ValidationInfo) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            missing = "tls.key_file" if self.key_file is None else "tls.cert_file"
            raise ValueError(f"{missing}: required with the other tls file (give both or neither)")
        if (info.context or {}).get(CHECK_FILES, True):
            for name, path in (("tls.cert_file", self.cert_file), ("tls.key_file", self.key_file)):
                if path is not None and not Path(path).is_file():
                    raise ValueError(f"{name}: no such file: {path}")
        return self

    @property
    def enabled(self) -> bool:
        """TLS on gRPC (the Router's server)."""
        return self.cert_file is not None

    @property
    def on_http(self) -> bool:
        return self.enabled and self.http_proxy


def check_bind_host(host: str, field: str) -> str:
    """An IP literal to bind (127.0.0.1 / ::1 loopback, 0.0.0.0 / :: every interface) or `localhost`."""
    if host == "localhost":
        return host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{field}: {host!r} is not an IP address to listen on (e.g. 127.0.0.1 or 0.0.0.0)") from None
    return host


def is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


class IncrementalConfig(_Strict):
    """Incremental text (WebSocket `/v1/audio/speech/stream`, the router's `IncrementalSession`):
    text arrives in pieces, is cut into segments at sentence / clause boundaries, and each
    segment is synthesized in order with the stream's voice, seed and sampling."""

    idle_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="A stream that waits this long for text (nothing left to speak) is closed."
    )
    max_piece_chars: int = Field(1000, ge=1, le=100_000, description="Longest text piece one message may carry.")
    min_clause_chars: int = Field(
        24, ge=1, description="A clause boundary (, ; : dash) ends a segment once it holds this many characters; "
        "a sentence end (. ! ?) always does."
    )  # fmt: skip
    max_segment_chars: int = Field(
        400, ge=16, description="A segment without a boundary is cut at its last space past this many characters."
    )
    fade_ms: float = Field(
        4.0, ge=0, le=100, description="Linear fade at each segment join (out at a segment's end, in at the next "
        "one's start), so joined segments meet at zero: no click."
    )  # fmt: skip
    max_context_turns: int = Field(
        2, ge=0, le=16, description="Earlier segments a family that conditions on previous turns (CSM) is given."
    )
    lookahead_segments: int = Field(
        1, ge=0, le=4,
        description="Segments whose text is complete start this many ahead, while the one before still generates, "
        "so the join has no gap (the stream holds one more engine row meanwhile); 0 = one segment at a time. "
        "Families that condition on earlier segments' audio (CSM) always go one at a time.",
    )  # fmt: skip


class VoicesConfig(_Strict):
    """Zero-shot voices (`POST /v1/voices`, gRPC `RegisterVoice`; families with a flow detokenizer that
    take them: cosyvoice2). A voice is encoded once, in the app's VoiceBank actor, and its tensors
    reach each detok replica over `transport`, once per replica."""

    transport: Literal["gloo", "object_store"] = Field(
        "gloo",
        description="How voice tensors cross to the detok replicas: Ray Direct Transport over torch gloo, point to "
        "point (the default, on CPU and GPU clusters alike: a voice is tens of KB, sent once per replica, and moves "
        "to the GPU inside the codec), or the object store (the fallback wherever RDT cannot run). nccl is not "
        "offered: its endpoints would each need a GPU of their own.",
    )
    encoder_dir: Path | str | None = Field(
        None,
        description="Published voice encoders (S3 speech tokenizer v2 + CAM++): chatterbox's s3gen.safetensors / "
        "s3gen.pt (its tokenizer.* and speaker_encoder.* tensors) or a directory with voice_encoders.pt; "
        "None = the model checkpoint directory's when it has them, else seeded tiny encoders (tests, CPU preset).",
    )
    min_clip_s: float = Field(1.0, gt=0, le=60, description="Shortest reference clip accepted.")
    max_clip_s: float = Field(20.0, gt=0, le=30, description="Longest reference clip (the tokenizer's window is 30 s).")
    max_prompt_text_chars: int = Field(1000, ge=0, le=10_000, description="Longest transcript of a clip.")
    max_voices: int = Field(1000, ge=1, le=1_000_000, description="Voices the VoiceBank keeps; more are refused.")
    default_clip: Path | None = Field(
        None,
        description="A reference clip (PCM WAV, min_clip_s..max_clip_s long) whose voice a request naming none speaks "
        "in, for the families whose detokenizer alone takes the voice (cosyvoice2, step-audio2): encoded by the same "
        "encoders as a registration when each detok replica starts. None = the model's own default (a checkpoint's "
        "built-in voice where it has one, else a seeded x-vector with no prompt).",
    )
    default_clip_text: str = Field(
        "",
        description="The transcript of default_clip. With it, a family whose LM reads a voice's transcript "
        "(cosyvoice2) is prompted for a request naming no voice as for the clip registered with this prompt_text "
        "(its zero-shot mode: transcript + the clip's speech tokens; each LLM replica encodes the clip at its "
        "start); '' = the LM is not prompted with the clip (its cross-lingual mode) and the voice conditions the "
        "detokenizer only.",
    )

    @model_validator(mode="after")
    def _bounds(self, info: ValidationInfo) -> VoicesConfig:
        if self.min_clip_s >= self.max_clip_s:
            raise ValueError("voices.min_clip_s must be < voices.max_clip_s")
        if self.default_clip_text and self.default_clip is None:
            raise ValueError("voices.default_clip_text: is the transcript of voices.default_clip, which is not set")
        if len(self.default_clip_text) > self.max_prompt_text_chars:
            raise ValueError(f"voices.default_clip_text: is {len(self.default_clip_text)} characters; at most "
                             f"voices.max_prompt_text_chars ({self.max_prompt_text_chars})")  # fmt: skip
        if any(not ch.isprintable() and ch not in " \n\t" for ch in self.default_clip_text):  # (as a registration's)
            raise ValueError("voices.default_clip_text: holds control characters")
        if (info.context or {}).get(CHECK_FILES, True) and self.default_clip is not None:
            if not Path(self.default_clip).is_file():
                raise ValueError(f"voices.default_clip: no such file: {self.default_clip}")
        return self


class ServedModelConfig(_Strict):
    """One model of a multi-model app (`ServeConfig.models`): its engines and its stages' deployments.
    Models whose detokenizer is the same (codec, weights, chunk settings) share one DetokStage
    deployment, which takes the first such model's `detok` deployment settings."""

    engine: EngineConfig = Field(description="This model's engines; `engine.model.name` is the name clients send.")
    llm: StageDeploymentConfig = StageDeploymentConfig()
    detok: StageDeploymentConfig = StageDeploymentConfig()


class SpeechInConfig(_Strict):
    """Audio a request carries to the LM (speech in: families that take audio, step-audio2), checked at the
    ingress: a longer clip is refused (it costs prefill: ~12.5 LM positions per second of audio)."""

    min_audio_s: float = Field(0.1, gt=0, le=10, description="Shortest input audio accepted.")
    max_audio_s: float = Field(60.0, gt=0, le=600, description="Longest input audio accepted.")


class ServeConfig(_Strict):
    """The whole cluster app: engines, the three deployments, admission, ports, what is exposed.

    One model: `engine`, `llm` and `detok`. Several: `models`, a list of `ServedModelConfig`, each
    with its own LLM deployment; `engine`, `llm` and `detok` are then left out (`served_models()`
    gives the list either way)."""

    app_name: str = Field("voxray", pattern=r"^[a-z0-9][a-z0-9-]*$")
    route_prefix: str = Field("/", pattern=r"^/")
    http_host: str = Field(
        "127.0.0.1", description="Address Serve's HTTP proxy listens on: 127.0.0.1 (default) or 0.0.0.0 (all, k8s)."
    )
    http_port: int = Field(8000, ge=1, le=65535)
    grpc_host: str = Field(
        "127.0.0.1",
        description="Address the Router's gRPC server listens on: 127.0.0.1 (default) or 0.0.0.0 / :: (all, k8s).",
    )
    grpc_port: int = Field(
        9000,
        ge=1,
        le=65535,
        description="gRPC port of this app (one app per port; the Router replicas of a node share it).",
    )
    ray_loopback_only: bool = Field(
        True,
        description="The embedded local Ray (`voxray serve` without --address) listens on 127.0.0.1 only: GCS, "
        "raylet, workers, agents, metrics exporter, Serve replicas. False: Ray's default, the node's network "
        "address (a head other machines join). Not used when joining a running cluster (KubeRay starts Ray).",
    )
    tls: TlsConfig = TlsConfig()
    http_docs: bool = Field(False, description="Serve /docs, /redoc and /openapi.json (off: 404).")
    grpc_reflection: bool = Field(
        False, description="Serve gRPC server reflection for voxray.Speech (off: UNIMPLEMENTED)."
    )
    engine: EngineConfig = EngineConfig(
        model=ModelConfig(torch_threads=1), cache=CacheConfig(num_slots=16, max_seq_len=2048),
        scheduler=SchedulerConfig(max_batch_size=16),
    )  # fmt: skip
    llm: StageDeploymentConfig = StageDeploymentConfig()
    detok: StageDeploymentConfig = StageDeploymentConfig()
    router: StageDeploymentConfig = StageDeploymentConfig(num_cpus=0.25, max_ongoing_requests=1024)
    admission: AdmissionConfig = AdmissionConfig()
    auth: AuthConfig = AuthConfig()
    drain: DrainConfig = DrainConfig()
    rebalance: RebalanceConfig = RebalanceConfig()
    migration: MigrationConfig = MigrationConfig()
    incremental: IncrementalConfig = IncrementalConfig()
    voices: VoicesConfig = VoicesConfig()
    models: tuple[ServedModelConfig, ...] = Field(
        (),
        description="Several models in one app, each with its own LLM deployment (detokenizer deployments shared "
        "where models' detokenizers are the same); requests pick one by their `model` field, empty = the first. "
        "Empty = the one model of `engine` / `llm` / `detok`.",
    )
    speech_in: SpeechInConfig = SpeechInConfig()

    @field_validator("http_host", "grpc_host")
    @classmethod
    def _bind_host(cls, host: str, info: ValidationInfo) -> str:
        return check_bind_host(host, info.field_name)

    @model_validator(mode="after")
    def _streams_fit_cache(self) -> ServeConfig:
        for where, served in self._named_engines():
            if self.admission.max_streams_per_replica > served.engine.cache.num_slots:
                raise ValueError(f"admission.max_streams_per_replica must be <= {where}engine.cache.num_slots")
        return self

    @model_validator(mode="after")
    def _models_listed_once(self) -> ServeConfig:
        """With `models`, the single-model fields stay at their defaults (one place names each model's
        engines), and no name is listed twice (clients pick a model by name)."""
        if not self.models:
            return self
        for name in ("engine", "llm", "detok"):
            if getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"{name}: give each model's {name} under models[i].{name}, not beside `models`")
        names = [served.engine.model.name for served in self.models]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"models: {', '.join(twice)} listed more than once (engine.model.name must differ)")
        return self

    def served_models(self) -> tuple[ServedModelConfig, ...]:
        """The models this app serves, first = the default for a request naming none."""
        return self.models or (ServedModelConfig(engine=self.engine, llm=self.llm, detok=self.detok),)

    def for_model(self, served: ServedModelConfig) -> ServeConfig:
        """This config as one model's stages see it: that model's `engine`, `llm` and `detok`, no `models`."""
        return self.model_copy(update={"engine": served.engine, "llm": served.llm, "detok": served.detok, "models": ()})

    def _named_engines(self) -> list[tuple[str, ServedModelConfig]]:
        if not self.models:
            return [("", ServedModelConfig(engine=self.engine))]
        return [(f"models[{i}].", served) for i, served in enumerate(self.models)]

    @model_validator(mode="after")
    def _open_only_on_purpose(self) -> ServeConfig:
        """Beyond loopback, no keys file is an error unless `auth.allow_open` says it is meant."""
        exposed = [name for name in ("http_host", "grpc_host") if not is_loopback(getattr(self, name))]
        if self.auth.api_keys_file is not None and self.auth.allow_open:
            raise ValueError("auth.allow_open: true contradicts auth.api_keys_file (keys are required when named)")
        if exposed and self.auth.api_keys_file is None and not self.auth.allow_open:
            where = ", ".join(f"{name} {getattr(self, name)}" for name in exposed)
            raise ValueError(
                f"auth.api_keys_file: required when listening beyond loopback ({where}): name a file of key digests "
                "(README, API keys), or set auth.allow_open: true to serve every client without a key"
            )
        return self


def http_proxy_options(config: ServeConfig) -> dict:
    """Serve's HTTP proxy options (`serve.start`, Serve YAML `http_options`): where it listens, and TLS."""
    options: dict = {"host": config.http_host, "port": config.http_port}
    if config.tls.on_http:
        options |= {"ssl_certfile": str(config.tls.cert_file), "ssl_keyfile": str(config.tls.key_file)}
    return options


def load_serve_config(path: Path, check_files: bool = True) -> ServeConfig:
    """Read a ServeConfig from a YAML file (the file `voxray serve --config` takes). `check_files=False`
    skips checking that files it names (TLS) exist here: a config rendered for other machines (k8s)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    return ServeConfig.model_validate(data, context={CHECK_FILES: check_files})

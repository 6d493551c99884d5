"""CosyVoice 2 at VoxServe's setting (issue 38 item 4): the `voxserve_setting` section of `loadtest.family_gpu_bench`.

VoxServe's setting: temperature 0.8, top-p 0.95, top-k 50, repetition penalty 1.1, one fixed reference voice,
chunks of 15 tokens; capacity at p90 TTFA <= 500 ms with 100% of streams viable (VoxServe: 4.0 req/s on an H100;
our target >= 8 on one H200). The section runs the family bench's in-process Poisson sweep (`family_sections.rates_at`)
with every request made that way:
- sampling: those four fields and `ras_window` 0 (no repetition-aware sampling: the cosyvoice2 default's RAS is not
  part of VoxServe's setting); `repetition_window` 0 = the whole history, which for cosyvoice2 is its speech ids
  (the voice's prompt speech + the output, `CosyVoice2Adapter.history_ids`).
- voice: one registered zero-shot voice (`REFERENCE_CLIP_S` of seeded random speech tokens, mel and x-vector, and a
  transcript), in the LM prompt (transcript + prompt speech, CosyVoice's zero-shot layout) and in the flow (prompt
  tokens + mel + x-vector) of every request.
- chunks: the LLM sends the detokenizer 15-token chunks (first one included), each with the 3 look-ahead tokens and
  the stream from token 0. S3Gen's flow still runs whole 25-token attention chunks (the published model's chunk mask,
  `s3gen_codec.STREAM_CHUNK_TOKENS`; a 15-token mask would be another model), counted over prompt + generated tokens,
  and HiFT holds back its last frames: a 15-token chunk only changes when tokens leave the LLM, and audio leaves
  with the first chunk whose tokens complete a flow chunk. `release_points` works out where, for this voice, against
  the family's own schedule (50 tokens, then 25).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cluster.pipeline import InProcessPipeline
from core.config import EngineConfig
from core.messages import SamplingParams, VoiceConditioning
from core.voices import VOICE_ID_PREFIX, VoicePrompt
from detok_stage.codecs.s3gen_codec import STREAM_CHUNK_TOKENS, S3GenCodec
from detok_stage.flow.hift import F0_RADIUS
from llm_stage.chunking import WHOLE_STREAM_FRAMES, ChunkSchedule
from llm_stage.histories import uses_incremental_history
from llm_stage.models.cosyvoice2 import FRAME_RATE_HZ, S3GEN_SCHEDULE
from llm_stage.models.cosyvoice2_lm import SPEECH_TOKEN_SIZE
from loadtest.family_sections import SloRule, rates_at
from loadtest.gpu_bench_pipeline import TEXTS, lone_ttfa_s, pipeline_config

if TYPE_CHECKING:
    from loadtest.family_gpu_bench import FamilyRun

ENTRY = "cosyvoice2-0.5b"  # the family bench entry this section runs for
VOXSERVE_SAMPLING: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1,
                                     "ras_window": 0, "repetition_window": 0}  # fmt: skip
VOXSERVE_SLO = SloRule(p90_ttfa_s=0.5, viable_pct=100.0)
CHUNK_TOKENS = 15  # VoxServe's chunk
TARGET_RPS, VOXSERVE_H100_RPS = 8.0, 4.0
REFERENCE_CLIP_S = 3.5  # VoxServe's reference clip is a short sentence, about this long
REFERENCE_TRANSCRIPT = "A short reference sentence, read once, that every request is spoken in."
VOICE_SEED = 38
RELEASE_HORIZON_TOKENS = 150  # `release_points` over a stream's first 6 s


def reference_voice(codec: S3GenCodec, model: str) -> tuple[VoicePrompt, VoiceConditioning]:
    """The fixed reference voice: seeded speech tokens (25 Hz), their mel (2 frames per token) and an x-vector
    at the codec's sizes, with a transcript; its id content-addressed as a registered voice's."""
    gen = torch.Generator().manual_seed(VOICE_SEED)
    count = round(REFERENCE_CLIP_S * FRAME_RATE_HZ)
    tokens = torch.randint(0, min(codec.codebook_size, SPEECH_TOKEN_SIZE), (count,), generator=gen)
    config = codec.config
    mel = torch.randn(config.token_mel_ratio * count, config.mel_bins, generator=gen) - 5.0  # log-mel-like
    xvector = torch.randn(config.spk_embed_dim, generator=gen)
    digest = hashlib.sha256(f"{model}|{REFERENCE_TRANSCRIPT}|{tokens.tolist()}".encode()).hexdigest()
    voice_id = VOICE_ID_PREFIX + digest[:24]
    prompt = VoicePrompt(voice_id, REFERENCE_TRANSCRIPT, tuple(int(t) for t in tokens))
    return prompt, VoiceConditioning(voice_id, tokens, mel, xvector)


def register_voice(run: FamilyRun) -> VoicePrompt:
    """The voice on the run's adapter and codec (the pipelines built in this entry share them)."""
    prompt, conditioning = reference_voice(run.codec, run.entry.model)
    run.adapter.add_voice_prompt(prompt)
    run.codec.add_voice(conditioning)
    return prompt


@dataclass
class FixedSetting:
    """The pipeline as the sweep drives it, with every request made with `sampling` and `voice` (the sweep's own
    fields, max_tokens and seed, kept); everything else goes to the pipeline."""

    pipe: InProcessPipeline
    voice: str
    sampling: dict[str, Any]

    def submit(self, req_id: str, text: str, voice: str | None = None, sampling: dict | None = None) -> None:
        self.pipe.submit(req_id, text, self.voice, {**(sampling or {}), **self.sampling})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)


def chunk_schedule(chunk_tokens: int) -> ChunkSchedule:
    """`chunk_tokens` per chunk, the first one too; S3Gen's look-ahead; the stream from token 0 as history."""
    return ChunkSchedule(chunk_tokens, chunk_tokens, WHOLE_STREAM_FRAMES, S3GenCodec.min_right_context_frames)


def engine_config(run: FamilyRun, chunk_tokens: int) -> EngineConfig:
    """The family bench's streaming pipeline with the LLM -> detokenizer chunks of `chunk_schedule`."""
    config = pipeline_config(run, "streaming")
    s = chunk_schedule(chunk_tokens)
    detok = config.detok.model_copy(update={
        "schedule": "wide", "first_chunk_frames": s.first_chunk_frames, "chunk_frames": s.chunk_frames,
        "left_context_frames": s.left_context_frames, "right_context_frames": s.right_context_frames,
        "adaptive": False})  # fmt: skip
    return config.model_copy(update={"detok": detok})


def release_points(
    schedule: ChunkSchedule, prompt_tokens: int, flow_chunk: int, lookahead: int, mel_per_token: int,
    held_mel: int, mel_hz: float, upto: int,
) -> list[dict]:  # fmt: skip
    """Where audio leaves a stream under `schedule` (not its last chunk): each chunk that adds audio, as the
    generated tokens it is cut at (kept + look-ahead) and the audio seconds out so far. A chunk keeping tokens to
    k gives the flow prompt + k + look-ahead tokens; the flow runs every whole `flow_chunk` (over prompt + generated
    tokens) whose look-ahead is in; HiFT emits all but `held_mel` of the generated mel frames."""
    points, kept, seq, out_mel = [], 0, 0, 0
    while True:
        kept += schedule.chunk_size(seq)
        seq += 1
        if kept > upto:
            return points
        flow_done = (prompt_tokens + kept) // flow_chunk * flow_chunk
        mel = max(0, mel_per_token * max(0, flow_done - prompt_tokens) - held_mel)
        if mel > out_mel:
            points.append({"cut_at_tokens": kept + lookahead, "audio_s": round(mel / mel_hz, 3)})
            out_mel = mel


def chunk_report(run: FamilyRun, chunk_tokens: int, prompt_tokens: int) -> dict:
    """What "chunk 15 tokens" became, and where audio leaves for this voice, this schedule vs the family's."""
    codec = run.codec
    config, hift = codec.config, codec.model.mel2wav
    held_mel = hift.decode_radius + F0_RADIUS
    mel_hz = config.hift.sampling_rate / hift.hop

    def points(schedule: ChunkSchedule) -> list[dict]:
        return release_points(schedule, prompt_tokens, config.chunk_tokens, config.pre_lookahead_len,
                              config.token_mel_ratio, held_mel, mel_hz, RELEASE_HORIZON_TOKENS)  # fmt: skip

    return {
        "chunk_tokens_sent": chunk_tokens, "first_chunk_tokens_sent": chunk_tokens,
        "right_context_tokens": config.pre_lookahead_len, "left_context": "the stream from token 0 (cold replicas)",
        "flow_attention_chunk": config.chunk_tokens, "published_flow_chunk": STREAM_CHUNK_TOKENS,
        "hift_held_mel_frames": held_mel, "voice_prompt_tokens": prompt_tokens,
        "why": f"S3Gen's flow streams whole {config.chunk_tokens}-token attention chunks (the published chunk mask, "
        f"counted over prompt + generated tokens) and HiFT holds back its last {held_mel} mel frames: a "
        f"{chunk_tokens}-token chunk changes when tokens leave the LLM; audio leaves with the first chunk whose tokens "
        "complete a flow chunk (audio_leaves: the generated tokens it is cut at, the audio out by then)",
        "audio_leaves": points(chunk_schedule(chunk_tokens)), "family_default_audio_leaves": points(S3GEN_SCHEDULE),
        "family_default": {"first_chunk_tokens": S3GEN_SCHEDULE.first_chunk_frames,
                           "chunk_tokens": S3GEN_SCHEDULE.chunk_frames},
    }  # fmt: skip


def sampler_report(run: FamilyRun, pipe: InProcessPipeline, resolved: SamplingParams) -> dict:
    """Where this sampling runs (item 2): on a GPU the draw is `sampler.sample_on_device` (penalty, temperature,
    top-k / top-p race, no read-back but the ids) unless a row is repetition-aware; the penalty's histories are
    the host's part, kept incrementally (`llm_stage.histories`) or walked per row per step."""
    incremental = uses_incremental_history(pipe.llm.engine.adapter)
    if resolved.is_repetition_aware:
        draw = "llm_stage.ras (repetition-aware rows)"
    elif run.is_cuda:
        draw = "device (sample_on_device): penalty scatter, temperature, top-k / top-p race; the ids read back once"
    else:
        draw = "host (CPU logits are sampled in numpy)"
    return {
        "repetition_aware_rows": resolved.is_repetition_aware, "draw": draw,
        "row_table": "one host row per request (its parameters and penalty ids) built while the forward runs, "
        "sent in one non-blocking copy" if run.is_cuda else None,
        "penalty_history": "incremental per request (llm_stage.histories: new tokens only)" if incremental
        else "walked per row per step on the host (LMAdapter.penalty_history)",
    }  # fmt: skip


def voxserve_section(run: FamilyRun) -> dict:
    """c=1 TTFA (the first one cold) and the Poisson rates at VoxServe's setting; capacity at p90 TTFA <= 0.5 s
    with 100% viable, higher rates skipped once one misses."""
    args = run.args
    prompt = register_voice(run)
    sampling = dict(VOXSERVE_SAMPLING)
    resolved = SamplingParams.resolve(sampling, run.adapter.default_sampling)
    pipe = InProcessPipeline(engine_config(run, args.voxserve_chunk_tokens))
    driven = FixedSetting(pipe, prompt.voice_id, sampling)
    out: dict = {
        "setting": {"sampling": sampling, "sampling_resolved": resolved.model_dump(), "voice": {
            "voice_id": prompt.voice_id, "clip_s": REFERENCE_CLIP_S, "prompt_speech_tokens": len(prompt.prompt_tokens),
            "transcript": prompt.prompt_text, "every_request": True},
            "per_request_also": "the sweep's max_tokens and seed"},
        "chunk": chunk_report(run, args.voxserve_chunk_tokens, len(prompt.prompt_tokens)),
        "slo": VOXSERVE_SLO.as_dict(), "target_rps": TARGET_RPS, "voxserve_h100_rps": VOXSERVE_H100_RPS,
        "max_tokens": args.max_tokens,
    }  # fmt: skip
    try:
        start = time.monotonic()
        out["c1_ttfa_s"] = [lone_ttfa_s(driven, f"vx-c1-{i}", TEXTS[i % len(TEXTS)], args.max_tokens)
                            for i in range(2)]  # fmt: skip
        out["c1_s"] = round(time.monotonic() - start, 1)
        out["sampler"] = sampler_report(run, pipe, resolved)
        out |= rates_at(run, driven, args.voxserve_rates, VOXSERVE_SLO, stop_after_miss=True)
    finally:
        pipe.close()
    out["meets_target"] = out["capacity_at_slo_rps"] >= TARGET_RPS
    return out


def headline(report: dict) -> str | None:
    """One line under the bench's table: the capacity at VoxServe's setting and each rate's p90 / viable."""
    data = report.get("families", {}).get(ENTRY, {}).get("voxserve_setting")
    if not data or not data.get("ok"):
        return None if not data else f"{ENTRY} voxserve_setting failed: {data.get('error', '')[:200]}"
    per_rate = "; ".join(
        f"{rate}/s: " + (f"p90 {r['p90_ttfa_s']} s, {r['viable_pct']}% viable" if "viable_pct" in r else r["skipped"])
        for rate, r in data["rates"].items()
    )
    chunk = data["chunk"]
    return (
        f"{ENTRY} at VoxServe's setting (T 0.8, top-p 0.95, top-k 50, rep 1.1, one voice, "
        f"{chunk['chunk_tokens_sent']}-token chunks sent, flow chunk {chunk['flow_attention_chunk']}): "
        f"{data['capacity_at_slo_rps']:g} req/s at p90 TTFA <= {VOXSERVE_SLO.p90_ttfa_s:g} s and "
        f"{VOXSERVE_SLO.viable_pct:g}% viable (target {TARGET_RPS:g}; VoxServe {VOXSERVE_H100_RPS:g} on an H100); "
        + per_rate
    )

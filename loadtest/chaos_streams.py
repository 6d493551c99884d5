"""The chaos bench's streams: the workload plan (Poisson arrivals of the sweep's prompts, each a
greedy, seeded or incremental-text stream), playing one stream over gRPC or the WebSocket with
every chunk's time on the bench's clock, how a stream ended (finished, refused with its reason,
failed), whether it stayed viable, and its audio against an undisturbed in-process run.
Used by `loadtest.chaos_bench`; pure except `play` and `reference_audio`.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass, field

import grpc
import numpy as np

from cluster.client import make_request
from core.config import EngineConfig
from loadtest.metrics import RequestRecord, is_viable, ttfa_s, worst_underrun_s
from loadtest.workload import (
    ORPHEUS_FRAME_RATE_HZ,
    ORPHEUS_TOKENS_PER_FRAME,
    arrival_offsets_s,
    load_prompts,
    max_tokens_for,
)
from protos import voxray_pb2_grpc

VOICE = "tara"
KINDS = ("greedy", "seeded", "incremental")
INCREMENTAL_MAX_TOKENS = 7 * 12  # per segment: random weights never stop on their own
INCREMENTAL_WORDS_PER_S = 30.0  # an LLM writing its reply (loadtest.incremental_bench's pace)
REFUSAL_CODES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"})
MAX_PCM_DIFF = 2  # same tokens: SNAC's float noise of batched decoding only (as tests/deployments)
MAX_STREAMS = 100_000
NORMAL_CLOSE = 1000  # the WebSocket's close code after its `done` message


@dataclass(frozen=True)
class StreamSpec:
    req_id: str
    kind: str  # one of KINDS
    text: str
    sampling: dict
    scheduled_s: float  # send time since the bench's start


@dataclass
class StreamResult:
    spec: StreamSpec
    sent_s: float = 0.0  # since the bench's start
    ended_s: float = 0.0
    code: str = "OK"  # gRPC status name (incremental: the error message's code); CLIENT_OVERFLOW: not sent
    details: str = ""
    chunk_times_s: list[float] = field(default_factory=list)  # since the bench's start
    chunk_durations_s: list[float] = field(default_factory=list)
    llm_replicas: list[str] = field(default_factory=list)  # in the order they served the stream
    detok_replicas: list[str] = field(default_factory=list)
    audio: bytes = b""
    same_audio: bool | None = None  # None: not compared (incremental, or did not finish)
    max_pcm_diff: int | None = None

    def on_chunk(self, duration_s: float, audio: bytes, llm_replica: str, detok_replica: str, now_s: float) -> None:
        self.chunk_times_s.append(now_s)
        self.chunk_durations_s.append(duration_s)
        self.audio += audio
        for seen, replica in ((self.llm_replicas, llm_replica), (self.detok_replicas, detok_replica)):
            if replica and (not seen or seen[-1] != replica):
                seen.append(replica)

    @property
    def num_audio_chunks(self) -> int:
        return sum(d > 0 for d in self.chunk_durations_s)

    @property
    def audio_ahead_s(self) -> float:
        """Audio the stream has still to send (orpheus-tiny: `max_tokens` always runs out, never EOS)."""
        frames = self.spec.sampling["max_tokens"] / ORPHEUS_TOKENS_PER_FRAME
        return frames / ORPHEUS_FRAME_RATE_HZ - sum(self.chunk_durations_s)

    @property
    def is_sent(self) -> bool:
        return self.code != "CLIENT_OVERFLOW"

    @property
    def is_refused(self) -> bool:
        """Answered with a retry-able refusal before any audio: not admitted."""
        return self.code in REFUSAL_CODES and self.num_audio_chunks == 0

    @property
    def is_finished(self) -> bool:
        return self.code == "OK" and self.num_audio_chunks > 0

    @property
    def record(self) -> RequestRecord:
        """The stream as loadtest.metrics sees one (times since its send)."""
        arrivals = [t - self.sent_s for t in self.chunk_times_s]
        return RequestRecord(arrivals_s=arrivals, durations_s=list(self.chunk_durations_s), is_ok=self.is_finished,
                             error="" if self.is_finished else self.code)  # fmt: skip

    @property
    def is_viable(self) -> bool:
        """Finished, and no chunk came after the audio before it had played out (no underrun)."""
        return is_viable(self.record)

    def refusal_reason(self) -> str:
        """`CODE: message` with the request id and numbers masked, to count refusals by reason."""
        message = re.sub(r"[0-9]+(\.[0-9]+)?", "#", self.details.replace(self.spec.req_id, "<id>"))
        return f"{self.code}: {message}"

    def to_json(self) -> dict:
        record = self.record
        return {
            **asdict(self.spec), "sent_s": round(self.sent_s, 3), "ended_s": round(self.ended_s, 3),
            "code": self.code, "details": self.details, "finished": self.is_finished, "refused": self.is_refused,
            "viable": self.is_viable if self.is_finished else None, "num_chunks": len(self.chunk_times_s),
            "ttfa_s": ttfa_s(record.arrivals_s, record.durations_s),
            "worst_underrun_s": round(worst_underrun_s(record.arrivals_s, record.durations_s), 3),
            "audio_s": round(sum(self.chunk_durations_s), 3), "llm_replicas": self.llm_replicas,
            "detok_replicas": self.detok_replicas, "same_audio": self.same_audio, "max_pcm_diff": self.max_pcm_diff,
        }  # fmt: skip


def plan_streams(rate_rps: float, duration_s: float, incremental_share: float, seed: int) -> list[StreamSpec]:
    """Poisson arrivals over `duration_s`; each stream incremental with `incremental_share`, else
    greedy or seeded (half each), asking for as much audio as its prompt would take to say."""
    rng = random.Random(seed)
    prompts = load_prompts()
    specs = []
    for i, offset in enumerate(arrival_offsets_s(rate_rps, duration_s, 1, MAX_STREAMS, rng)):
        text = prompts[rng.randrange(len(prompts))]
        kind = "incremental" if rng.random() < incremental_share else rng.choice(("greedy", "seeded"))
        max_tokens = INCREMENTAL_MAX_TOKENS if kind == "incremental" else max_tokens_for(text)
        sampling = {"temperature": 0.0} if kind == "greedy" else {"seed": seed * MAX_STREAMS + i}
        specs.append(StreamSpec(f"chaos-{i}", kind, text, {**sampling, "max_tokens": max_tokens}, offset))
    return specs


def play(result: StreamResult, stub: voxray_pb2_grpc.SpeechStub, ws_url: str, app_name: str, t0: float,
         timeout_s: float) -> None:  # fmt: skip
    """Play one stream to its end (every call bounded by `timeout_s`); never raises for its errors."""
    result.sent_s = time.monotonic() - t0
    try:
        if result.spec.kind == "incremental":
            _play_incremental(result, ws_url, t0, timeout_s)
        else:
            _play_grpc(result, stub, app_name, t0, timeout_s)
    except Exception as err:  # a client-side failure is recorded as the stream's outcome, not raised
        result.code, result.details = "CLIENT_ERROR", f"{type(err).__name__}: {err}"
    result.ended_s = time.monotonic() - t0


def _play_grpc(result: StreamResult, stub, app_name: str, t0: float, timeout_s: float) -> None:
    spec = result.spec
    request = make_request(spec.text, voice=VOICE, request_id=spec.req_id, sampling=spec.sampling)
    try:
        for chunk in stub.Synthesize(request, metadata=(("application", app_name),), timeout=timeout_s):
            result.on_chunk(chunk.duration_s, chunk.audio, chunk.llm_replica, chunk.detok_replica,
                            time.monotonic() - t0)  # fmt: skip
    except grpc.RpcError as err:
        result.code, result.details = err.code().name, err.details() or ""


def _play_incremental(result: StreamResult, ws_url: str, t0: float, timeout_s: float) -> None:
    """Typed word by word into the WebSocket; chunk times are the client's receipt times, put on the
    bench's clock from the first piece (the ready handshake before it is a few ms)."""
    from cluster.incremental_client import type_text

    spec = result.spec
    config = {"voice": VOICE, "sampling": spec.sampling, "request_id": spec.req_id}
    opened_s = time.monotonic() - t0
    typed = type_text(ws_url, spec.text, config, INCREMENTAL_WORDS_PER_S, timeout_s=timeout_s)
    for arrival_s, duration_s in zip(typed.chunk_arrivals_s, typed.chunk_durations_s, strict=True):
        result.chunk_times_s.append(opened_s + arrival_s)
        result.chunk_durations_s.append(duration_s)
    result.audio = typed.pcm16
    if typed.error is not None:
        result.code, result.details = str(typed.error.get("code", "ERROR")), str(typed.error.get("message", ""))
    elif typed.close_code != NORMAL_CLOSE or not typed.chunk_arrivals_s:
        result.code, result.details = "CLOSED", f"closed with code {typed.close_code} after {len(typed.pcm16)} bytes"


def comparable(results: list[StreamResult]) -> list[StreamResult]:
    """Finished greedy and seeded gRPC streams: their audio is fixed by their request alone."""
    return [r for r in results if r.spec.kind != "incremental" and r.is_finished]


def reference_audio(engine: EngineConfig, specs: list[StreamSpec], batch: int = 16) -> dict[str, bytes]:
    """Each request's audio from an undisturbed in-process run of the same engine, `batch` at a time."""
    from cluster.pipeline import InProcessPipeline

    pipeline = InProcessPipeline(engine)
    audio: dict[str, bytes] = {spec.req_id: b"" for spec in specs}
    try:
        for start in range(0, len(specs), batch):
            for spec in specs[start : start + batch]:
                pipeline.submit(spec.req_id, spec.text, VOICE, spec.sampling)
            for chunk in pipeline.stream():
                audio[chunk.req_id] += chunk.pcm16
    finally:
        pipeline.close()
    return audio


def compare_audio(result: StreamResult, expected: bytes) -> None:
    """Sets `same_audio` (same length, every sample within MAX_PCM_DIFF) and the largest difference."""
    got = np.frombuffer(result.audio, dtype="<i2").astype(np.int32)
    want = np.frombuffer(expected, dtype="<i2").astype(np.int32)
    if got.shape != want.shape or not got.size:
        result.same_audio, result.max_pcm_diff = False, None
        return
    result.max_pcm_diff = int(np.abs(got - want).max())
    result.same_audio = result.max_pcm_diff <= MAX_PCM_DIFF

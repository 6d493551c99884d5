"""Streaming-aware batch policy (pure Python), used by the LLM scheduler and the detokenizer.

Streams close to an underrun (urgent) go first, earliest playback deadline first; then
startup-phase requests (no audio sent yet, including new ones still to prefill), FCFS, at most
`startup_concurrency` of them; then the rest by slack; startups past the limit last. Slack =
audio buffered at the client - time to produce and ship the next chunk. A startup thus takes
rows only from streams that can afford to wait: near capacity, giving urgent rows to startups
made every stream underrun (BENCHMARKS "Urgent streams keep their rows"). The playback clock
(first audio, audio sent) is kept on each Request by whoever ships the audio.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.config import SchedulerConfig
from llm_stage.request import Request
from llm_stage.scheduler import DecodeOrder, DecodePriority, fcfs_order

URGENT_SLACK_S = 0.5  # below this a stream is urgent (EDF); above it, it only fills the batch


@dataclass
class StepTimer:
    """EMA of the engine step and of one detokenizer chunk, read by the policy."""

    step_s: float = 0.02
    detok_s: float = 0.05
    _seen: bool = False

    def record_step(self, elapsed_s: float) -> None:
        self.step_s = elapsed_s if not self._seen else 0.9 * self.step_s + 0.1 * elapsed_s
        self._seen = True

    def record_detok(self, elapsed_s: float) -> None:
        self.detok_s = 0.9 * self.detok_s + 0.1 * elapsed_s


def buffered_s(req: Request, now_s: float) -> float:
    """Audio at the client not yet played (playback starts with the first chunk)."""
    if req.first_audio_s is None:
        return 0.0
    return req.first_audio_s + req.audio_sent_s - now_s


def slack_s(req: Request, now_s: float, timer: StepTimer) -> float:
    produce_s = req.tokens_to_next_chunk * timer.step_s + timer.detok_s
    return buffered_s(req, now_s) - produce_s


class StreamingOrder:
    """A DecodeOrder: urgent (EDF) > startup, bounded, FCFS (decoding, then new requests'
    prefills) > the rest by slack > startups past the limit."""

    def __init__(self, startup_concurrency: int, timer: StepTimer, clock: Callable[[], float] = time.monotonic):
        self.startup_concurrency = startup_concurrency
        self.timer = timer
        self.clock = clock

    def __call__(self, requests: list[Request]) -> DecodePriority:
        now = self.clock()
        startup = fcfs_order([r for r in requests if r.first_audio_s is None])
        steady = [r for r in requests if r.first_audio_s is not None]
        slack = {id(r): slack_s(r, now, self.timer) for r in steady}
        urgent = sorted((r for r in steady if slack[id(r)] < URGENT_SLACK_S), key=lambda r: buffered_s(r, now))
        comfortable = sorted((r for r in steady if slack[id(r)] >= URGENT_SLACK_S), key=lambda r: slack[id(r)])
        first, deferred = startup[: self.startup_concurrency], startup[self.startup_concurrency :]
        return DecodePriority(urgent + first, self.startup_concurrency - len(first), comfortable + deferred)


def make_decode_order(config: SchedulerConfig, timer: StepTimer) -> DecodeOrder:
    """FCFS for `fcfs` and `throughput` (which ignores deadlines), StreamingOrder for `streaming`."""
    if config.policy == "streaming":
        return StreamingOrder(config.startup_concurrency, timer)
    return fcfs_order

"""The planner's workload: Poisson streams (text length -> audio frames -> LM tokens) and their chunks.

`make_streams` draws arrivals for a target number of concurrent streams (Little's law: rate = streams /
mean stream seconds) and `ChunkTable` lays each stream's chunks out with the real `ChunkSchedule`
(`llm_stage.chunking`: small first chunk, sizes doubling to the steady size, context frames), so the
simulator and the engines cut chunks alike. Used by `cluster.planner.simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.planner.calibration import ScheduleSpec
from core.errors import InvalidArgumentError
from llm_stage.chunking import ChunkSchedule


@dataclass(frozen=True)
class ModelRates:
    """A family's audio clock: codec frames per second and LM steps per frame (`LMAdapter.steps_per_frame`:
    the ids it samples per frame, and for GLM-4-Voice its interleaved text's steps too, 1.5)."""

    frame_rate_hz: float
    tokens_per_frame: float

    @property
    def frame_s(self) -> float:
        return 1.0 / self.frame_rate_hz

    @property
    def real_time_step_s(self) -> float:
        """The longest step that keeps every row at real time (Orpheus: 85.3 ms / 7 = 12.2 ms)."""
        return self.frame_s / self.tokens_per_frame


@dataclass(frozen=True)
class Workload:
    """What clients send: texts of `text_chars` characters (each request draws one, uniformly), spoken at
    `chars_per_audio_s`; prompts of `chars_per_prompt_token` characters a token plus the family's framing."""

    text_chars: tuple[int, ...] = (110,)  # ~7.2 s of audio: the GPU bench's 588-token streams
    chars_per_audio_s: float = 15.0  # loadtest/workload.py's speech rate
    chars_per_prompt_token: float = 4.0
    prompt_overhead_tokens: int = 8
    min_frames: int = 1
    max_frames: int = 100_000

    def frames_for(self, chars: np.ndarray, rates: ModelRates) -> np.ndarray:
        frames = np.round(chars / self.chars_per_audio_s * rates.frame_rate_hz).astype(np.int64)
        return np.clip(frames, self.min_frames, self.max_frames)

    def prompt_tokens_for(self, chars: np.ndarray) -> np.ndarray:
        """LM prompt positions of texts of `chars` characters: the text's tokens plus the family's framing."""
        return np.ceil(chars / self.chars_per_prompt_token).astype(np.int64) + self.prompt_overhead_tokens

    def max_frames_needed(self, rates: ModelRates) -> int:
        return int(self.frames_for(np.asarray([max(self.text_chars)], np.float64), rates)[0])

    def mean_audio_s(self, rates: ModelRates) -> float:
        frames = self.frames_for(np.asarray(self.text_chars, np.float64), rates)
        return float(frames.mean()) * rates.frame_s


@dataclass(frozen=True)
class Streams:
    """One Poisson run, in arrival order (a stream's id is its index)."""

    arrival_s: np.ndarray  # [N]
    frames: np.ndarray  # [N] audio frames
    prompt_tokens: np.ndarray  # [N]
    is_measured: np.ndarray  # [N] bool: arrived inside the measurement window

    @property
    def count(self) -> int:
        return len(self.arrival_s)


def draw_spans_s(concurrent: float, workload: Workload, rates: ModelRates, min_measured: int = 100,
                 draw_s: float = 0.0) -> tuple[float, float, float]:  # fmt: skip
    """One draw's (warm-up, measurement window, horizon) in seconds, as `make_streams` lays them out."""
    if draw_s > 0:
        return 0.0, draw_s, draw_s
    stream_s = workload.mean_audio_s(rates)
    measure_s = max(stream_s, min_measured / (concurrent / stream_s))  # at least `min_measured` arrivals
    return stream_s, measure_s, stream_s + measure_s + 1.5 * stream_s


def make_streams(
    concurrent: float, workload: Workload, rates: ModelRates, seed: int, min_measured: int = 100, draw_s: float = 0.0
) -> Streams:
    """Arrivals at rate = `concurrent` / mean stream seconds. `draw_s` 0 (steady): over warm-up (one mean
    stream), a measurement window (one mean stream, longer until `min_measured` arrivals) and a tail that keeps
    the load on. `draw_s` > 0 (a load test's draw): over `draw_s` seconds from an empty cluster, every arrival
    measured, no tail, as `loadtest.sweep` measures one rate (the shape `loadtest.plan_check` checks)."""
    if concurrent <= 0:
        raise InvalidArgumentError("streams", f"must be > 0, got {concurrent}")
    if draw_s < 0:
        raise InvalidArgumentError("draw_s", f"must be >= 0 (0: the steady window), got {draw_s}")
    rate = concurrent / workload.mean_audio_s(rates)
    warmup_s, measure_s, horizon_s = draw_spans_s(concurrent, workload, rates, min_measured, draw_s)
    rng = np.random.default_rng(seed)
    count = int(rng.poisson(rate * horizon_s)) + 1
    arrival_s = np.sort(rng.uniform(0.0, horizon_s, count))
    chars = rng.choice(np.asarray(workload.text_chars, np.float64), size=count)
    frames = workload.frames_for(chars, rates)
    prompt = workload.prompt_tokens_for(chars)
    measured = (arrival_s >= warmup_s) & (arrival_s < warmup_s + measure_s)
    if not measured.any():
        raise InvalidArgumentError("streams", f"no arrival to measure at {concurrent} streams; raise the load")
    return Streams(arrival_s, frames, prompt, measured)


@dataclass(frozen=True)
class ChunkRule:
    """How streams are cut: each chunk's planned size by seq (the real `ChunkSchedule.chunk_size`: small
    first, doubling to the steady size), its context frames, and the LLM side's slack cap: a chunk after the
    first is no longer than the frames the client's buffer can wait for (`llm_stage.side.LLMSide._frame_budget`:
    `buffer_safety` x buffered audio less one detokenizer step, over a frame's steps), and restarts at the
    first chunk's size when the buffer is spent."""

    planned: np.ndarray  # [K] frames kept by chunk seq (the last entry repeats)
    left_context_frames: int
    right_context_frames: int
    adaptive: bool
    buffer_safety: float = 0.7  # llm_stage.side.BUFFER_SAFETY

    @classmethod
    def from_spec(cls, spec: ScheduleSpec) -> ChunkRule:
        schedule = ChunkSchedule(
            spec.first_chunk_frames, spec.chunk_frames, spec.left_context_frames, spec.right_context_frames,
            spec.adaptive,
        )  # fmt: skip
        planned = np.asarray([schedule.chunk_size(seq) for seq in range(32)], np.int64)
        return cls(planned, spec.left_context_frames, spec.right_context_frames, spec.adaptive)

    @property
    def first_chunk_frames(self) -> int:
        return int(self.planned[0])

    def planned_size(self, seq: np.ndarray) -> np.ndarray:
        return self.planned[np.minimum(seq, len(self.planned) - 1)]

    def next_size(self, seq: np.ndarray, budget_frames: np.ndarray | None) -> np.ndarray:
        """Frames the next chunk keeps; `budget_frames` is None before any audio played."""
        size = self.planned_size(seq)
        if budget_frames is None or not self.adaptive:
            return size
        capped = np.where(budget_frames <= 0, self.first_chunk_frames, np.minimum(size, budget_frames))
        return np.where(seq == 0, size, np.maximum(capped, 1))

    def first_window(self, frames: int) -> tuple[int, int]:
        """(frames before chunk 0 can be cut, frames its window decodes) for a stream of `frames`."""
        ready = min(self.first_chunk_frames + self.right_context_frames, frames)
        return ready, ready

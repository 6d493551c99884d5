"""The detokenizer stage's measured pace, for admission (pure: no Ray).

Each DetokStage replica times its decode steps in a `DetokPace` and publishes a `DetokLoad`
through Serve's routing stats; the LLM replicas read those (router.dispatch's detok board) and
fold them with `summarize_detok` into their own load report, so admission predicts both stages.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from core.policy import MIN_STEP_SAMPLES, StepSamples

STREAM_WINDOW_S = 2.0  # a stream counts as running at the detok stage while it sent a chunk this recently
COST_WINDOW_S = 10.0  # decode steps the cost per audio second is measured over
SLACK_WINDOW_S = 5.0  # decoded chunks' slack before their playback deadline is kept this long


def step_s_at(step_s_by_size: dict[int, float], size: int) -> float | None:
    """Measured step time at a batch of `size`: the smallest measured batch at least that large,
    or, past the largest measured, that one scaled linearly (steps grow sublinearly with the
    batch, so this errs slow). None until a step was measured."""
    if not step_s_by_size:
        return None
    larger = [measured for measured in step_s_by_size if measured >= size]
    if larger:
        return step_s_by_size[min(larger)]
    largest = max(step_s_by_size)
    return step_s_by_size[largest] * size / largest


@dataclass(frozen=True)
class DetokLoad:
    """What one detok replica publishes through Serve's routing stats."""

    step_s_by_chunks: dict[int, float]  # one decode step, per number of chunks it decoded (measured sizes)
    busy_s_per_audio_s: float  # decode time per second of audio over the recent window; 0 = not measured
    num_queued_chunks: int  # chunks submitted and not decoded yet
    num_streams: int  # streams that sent a chunk within STREAM_WINDOW_S and have not ended
    reported_unix_s: float = 0.0

    def to_stats(self) -> dict:
        return asdict(self)

    @classmethod
    def from_stats(cls, stats: dict) -> DetokLoad | None:
        try:
            load = cls(**{k: stats[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError):
            return None
        return load if isinstance(load.step_s_by_chunks, dict) else None

    def real_time_streams(self) -> float:
        """Streams this replica keeps at real time: one second of audio per second each, at the
        decode cost per audio second measured over its recent steps, batched as they really were
        (0 = not measured yet). More streams only fill its batches better, so this errs low."""
        return 1.0 / self.busy_s_per_audio_s if self.busy_s_per_audio_s > 0 else 0.0

    def first_chunk_s(self) -> float:
        """Time until one more chunk sent now is decoded: the steps for the chunks queued ahead of
        it and itself, at the batch they make (0 = not measured yet)."""
        if not self.step_s_by_chunks:
            return 0.0
        batch = max(self.step_s_by_chunks)
        full_steps, last_chunks = divmod(self.num_queued_chunks + 1, batch)
        last_s = step_s_at(self.step_s_by_chunks, last_chunks) if last_chunks else 0.0
        return full_steps * self.step_s_by_chunks[batch] + (last_s or 0.0)


@dataclass(frozen=True)
class DetokSummary:
    """The detok stage as an LLM replica reports it (all detok replicas it calls)."""

    real_time_streams: float = 0.0  # streams the stage keeps at real time (sum over replicas); 0 = unknown
    num_streams: int = 0  # streams running through it (the largest count one replica saw)
    first_chunk_s: float = 0.0  # decode time of a new stream's first chunk on the best replica


def summarize_detok(loads: list[DetokLoad]) -> DetokSummary:
    """Fold the detok replicas' reports. A replica not measured yet counts for no capacity, so the
    stage's capacity is unknown (0) only while none is measured. Every replica sees chunks of
    (nearly) every running stream, so the largest count is the stage's."""
    measured = [load for load in loads if load.real_time_streams() > 0]
    if not measured:
        return DetokSummary()
    return DetokSummary(
        real_time_streams=sum(load.real_time_streams() for load in measured),
        num_streams=max(load.num_streams for load in loads),
        first_chunk_s=min(load.first_chunk_s() for load in measured),
    )


@dataclass
class DetokPace:
    """A detok replica's measurements: its decode steps by batch, its decode time per second of
    audio over the last COST_WINDOW_S, and which streams sent chunks lately. The replica's engine
    thread records; `load` reads."""

    clock: Callable[[], float] = time.monotonic
    steps_by_chunks: StepSamples = field(default_factory=StepSamples)
    _recent: deque = field(default_factory=deque)  # (when, decode s, audio s) of the steps in the window
    _window_busy_s: float = 0.0  # their sums, kept as steps come and go
    _window_audio_s: float = 0.0
    _busy_s_per_audio_s: float = 0.0  # the last figure measured (kept while the stage idles)
    _last_seen_s: dict[str, float] = field(default_factory=dict)  # req_id -> when its last chunk was decoded
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _warm: bool = False

    def record_step(
        self, elapsed_s: float, audio_s: list[float], req_ids: list[str], finished_ids: list[str] = ()
    ) -> None:
        """One decode step that decoded `len(audio_s)` chunks (of `req_ids`) in `elapsed_s`; the
        streams in `finished_ids` got their final chunk (they run here no more)."""
        if not audio_s:
            return
        if not self._warm:  # the first decode builds the codec's buffers: seconds on a busy CPU, not a step
            self._warm = True
            return
        now_s = self.clock()
        with self._lock:
            self.steps_by_chunks.record(len(audio_s), elapsed_s)
            self._recent.append((now_s, elapsed_s, sum(audio_s)))
            self._window_busy_s += elapsed_s
            self._window_audio_s += sum(audio_s)
            self._measure_cost(now_s)
            self._last_seen_s.update((req_id, now_s) for req_id in req_ids)
        self.forget(finished_ids)

    def _measure_cost(self, now_s: float) -> None:
        """Decode seconds per audio second over the steps of the last COST_WINDOW_S (once it holds
        MIN_STEP_SAMPLES steps): the batches as the streams' chunks really met, not the largest."""
        while self._recent and self._recent[0][0] < now_s - COST_WINDOW_S:
            _, busy_s, audio_s = self._recent.popleft()
            self._window_busy_s -= busy_s
            self._window_audio_s -= audio_s
        if len(self._recent) >= MIN_STEP_SAMPLES and self._window_audio_s > 0:
            self._busy_s_per_audio_s = self._window_busy_s / self._window_audio_s

    def forget(self, req_ids) -> None:
        """Streams that ended here (final chunk decoded, or cancelled): no longer counted as running."""
        with self._lock:
            for req_id in req_ids:
                self._last_seen_s.pop(req_id, None)

    def num_streams(self) -> int:
        since_s = self.clock() - STREAM_WINDOW_S
        with self._lock:
            self._last_seen_s = {req_id: at for req_id, at in self._last_seen_s.items() if at >= since_s}
            return len(self._last_seen_s)

    def busy_share(self) -> float:
        """Decode seconds per wall second over the last COST_WINDOW_S (1 = never idle): autoscaling."""
        with self._lock:
            self._measure_cost(self.clock())
            return self._window_busy_s / COST_WINDOW_S

    def load(self, num_queued_chunks: int) -> DetokLoad:
        with self._lock:
            step_s_by_chunks, busy_s_per_audio_s = self.steps_by_chunks.measured(), self._busy_s_per_audio_s
        return DetokLoad(
            step_s_by_chunks=step_s_by_chunks,
            busy_s_per_audio_s=busy_s_per_audio_s,
            num_queued_chunks=num_queued_chunks,
            num_streams=self.num_streams(),
            reported_unix_s=time.time(),
        )


@dataclass
class DeadlineSlack:
    """How much time a detok replica's decodes left before the streams' playback deadlines (a
    chunk's `deadline_s`: when the client's buffer runs dry; startups have none), over the last
    SLACK_WINDOW_S: its lag behind playback, for autoscaling (`core.autoscaling.detok_pressure`)."""

    clock: Callable[[], float] = time.time  # deadlines are wall-clock times
    _recent: deque = field(default_factory=deque)  # (decoded at, slack s)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, deadlines_s: list[float | None]) -> None:
        """Chunks decoded just now, with their deadlines."""
        now_s = self.clock()
        with self._lock:
            self._recent.extend((now_s, deadline_s - now_s) for deadline_s in deadlines_s if deadline_s is not None)

    def min_slack_s(self, none_s: float) -> float:
        """The least slack of the window's chunks (`none_s` when none had a deadline)."""
        since_s = self.clock() - SLACK_WINDOW_S
        with self._lock:
            while self._recent and self._recent[0][0] < since_s:
                self._recent.popleft()
            return min((slack_s for _, slack_s in self._recent), default=none_s)

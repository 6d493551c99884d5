"""The serving loop's recent steps and the process's garbage collections, to find where its time goes.

`EngineLoop` records every step its thread takes: when it began, how long it ran, the gap since the
previous step ended while there was work (the callers' window, the lock, the wait for the GIL) and the
batch size the step function reported (`StepReport`). The stages' `loop_trace()` hands the bounded record out; the
planner's stall measurement (`loadtest.loop_stalls`) reads it under load. `watch_gc` times the process's
garbage collections beside it.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from dataclasses import dataclass

TRACE_STEPS = 50_000  # steps kept (~5 MB): ~3 minutes of a loaded CPU replica, ~30 s of a fast GPU one
TRACE_GC_PAUSES = 2_000


@dataclass(frozen=True)
class StepReport:
    """What a loop's step function tells its trace: its batch size and whether it was decode work only."""

    size: int  # rows (LLM), chunks (detok)
    is_decode_only: bool = True  # False: it ran prompt work too (not a batch's steady pace)


@dataclass(frozen=True)
class TracedStep:
    start_s: float  # time.monotonic() when the step began
    step_s: float  # the step function's wall time
    gap_s: float  # since the previous step ended, while work waited (0 after an idle wait)
    size: int  # from the step's `StepReport` (0 when it returned none)
    is_decode_only: bool


@dataclass(frozen=True)
class GcPause:
    start_s: float  # time.monotonic()
    pause_s: float
    generation: int


class ProcessGc:
    """This process's garbage collections (every thread stops for one), timed by a `gc` callback."""

    def __init__(self, max_pauses: int = TRACE_GC_PAUSES) -> None:
        self.pauses: deque[GcPause] = deque(maxlen=max_pauses)
        self._started_s: float | None = None

    def on_gc(self, phase: str, info: dict) -> None:
        now = time.monotonic()
        if phase == "start":
            self._started_s = now
        elif self._started_s is not None:
            self.pauses.append(GcPause(self._started_s, now - self._started_s, int(info.get("generation", -1))))
            self._started_s = None

    def since(self, since_s: float) -> list[GcPause]:
        return [p for p in list(self.pauses) if p.start_s >= since_s]


PROCESS_GC = ProcessGc()


def watch_gc() -> None:
    """Time this process's collections from now on (once per process, however often called)."""
    if PROCESS_GC.on_gc not in gc.callbacks:
        gc.callbacks.append(PROCESS_GC.on_gc)


class LoopTrace:
    """Bounded record of a loop's steps; a snapshot adds the process's collections (`watch_gc`)."""

    def __init__(self, max_steps: int = TRACE_STEPS) -> None:
        self._steps: deque[TracedStep] = deque(maxlen=max_steps)
        self._last_end_s: float | None = None

    def idled(self) -> None:
        """The loop waited for work: the next step's gap is not a stall."""
        self._last_end_s = None

    def record(self, start_s: float, end_s: float, report: StepReport | None) -> None:
        gap_s = 0.0 if self._last_end_s is None else max(0.0, start_s - self._last_end_s)
        self._last_end_s = end_s
        report = report or StepReport(0)
        self._steps.append(TracedStep(start_s, end_s - start_s, gap_s, report.size, report.is_decode_only))

    def snapshot(self, since_s: float = 0.0) -> dict[str, list | float]:
        """The steps and collections from `since_s` (monotonic) on, as column lists (cheap to send)."""
        steps = [s for s in list(self._steps) if s.start_s >= since_s]  # list(): appends race the copy only
        pauses = PROCESS_GC.since(since_s)
        return {
            "start_s": [s.start_s for s in steps],
            "step_s": [s.step_s for s in steps],
            "gap_s": [s.gap_s for s in steps],
            "size": [s.size for s in steps],
            "decode_only": [s.is_decode_only for s in steps],
            "gc_start_s": [p.start_s for p in pauses],
            "gc_pause_s": [p.pause_s for p in pauses],
            "gc_generation": [p.generation for p in pauses],
            "now_s": time.monotonic(),
        }

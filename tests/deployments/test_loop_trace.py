"""The serving loop's trace: each step's wall time and size, the gap before it only while work waited,
and this process's garbage collections (`deployments.loop_trace`)."""

from __future__ import annotations

import gc
import threading
import time

from deployments.engine_loop import EngineLoop
from deployments.loop_trace import PROCESS_GC, LoopTrace, StepReport, watch_gc


def test_a_gap_counts_only_between_steps_that_had_work_waiting():
    trace = LoopTrace()
    trace.record(10.0, 10.5, StepReport(3))
    trace.record(10.7, 11.0, StepReport(4, is_decode_only=False))  # 0.2 s after the last step ended
    trace.idled()
    trace.record(20.0, 20.1, None)  # after an idle wait: no gap; a step function that reports nothing
    snap = trace.snapshot()
    assert snap["size"] == [3, 4, 0] and snap["decode_only"] == [True, False, True]
    assert [round(s, 6) for s in snap["step_s"]] == [0.5, 0.3, 0.1]
    assert [round(g, 6) for g in snap["gap_s"]] == [0.0, 0.2, 0.0]
    assert trace.snapshot(since_s=10.6)["start_s"] == [10.7, 20.0]


def test_the_trace_keeps_the_latest_steps_only():
    trace = LoopTrace(max_steps=3)
    for i in range(5):
        trace.record(float(i), i + 0.5, StepReport(i))
    assert trace.snapshot()["size"] == [2, 3, 4]


def test_collections_are_timed_once_per_process():
    watch_gc()
    watch_gc()
    assert gc.callbacks.count(PROCESS_GC.on_gc) == 1
    since_s = time.monotonic()
    gc.collect()
    pauses = LoopTrace().snapshot(since_s)
    assert pauses["gc_generation"][-1] == 2
    assert pauses["gc_pause_s"][-1] >= 0.0


def test_the_engine_loop_traces_its_steps_with_the_size_each_returned():
    sizes = iter(range(1, 1000))
    stepped = threading.Event()
    taken: list[int] = []

    def step() -> StepReport:
        size = next(sizes)
        taken.append(size)
        if size == 5:
            stepped.set()
        return StepReport(size, is_decode_only=size != 1)

    loop = EngineLoop(step, lambda: len(taken) < 5, lambda err: None, "test-engine")
    loop.start()
    try:
        assert stepped.wait(5)
        time.sleep(0.05)
    finally:
        loop.stop()
    snap = loop.trace.snapshot()
    assert snap["size"] == [1, 2, 3, 4, 5] and snap["decode_only"] == [False, True, True, True, True]
    assert all(step_s >= 0 for step_s in snap["step_s"]) and snap["gap_s"][0] == 0.0

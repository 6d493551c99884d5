"""EngineLoop fairness: a caller (add / cancel) never waits more than about one step; a failed step
goes to `on_error` and the loop steps on, unless the device is lost: then it stops, fails its health
check and ends the replica."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from deployments.engine_loop import EngineLoop, finish_on_thread
from llm_stage.faults import StepOutOfMemory


def busy_step(duration_s: float = 0.002) -> None:
    """Pure-Python work: holds the GIL like the Python parts of an engine step."""
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        pass


def worst_wait_s(enter, calls: int = 30) -> float:
    waits = []
    for _ in range(calls):
        start = time.perf_counter()
        with enter():
            waits.append(time.perf_counter() - start)
        time.sleep(0.001)
    return max(waits)


def test_callers_get_in_between_steps_of_a_busy_engine():
    loop = EngineLoop(busy_step, lambda: True, lambda err: None, "test-engine")
    loop.start()
    try:
        assert worst_wait_s(loop.exclusive) < 0.05  # ~25 steps of slack over the 1-step bound
    finally:
        loop.stop()


def test_exclusive_excludes_the_step():
    inside = threading.Event()
    overlaps = []

    def step() -> None:
        overlaps.append(inside.is_set())
        busy_step(0.001)

    loop = EngineLoop(step, lambda: True, lambda err: None, "test-engine")
    loop.start()
    try:
        for _ in range(20):
            with loop.exclusive():
                inside.set()
                time.sleep(0.002)
                inside.clear()
    finally:
        loop.stop()
    assert overlaps and not any(overlaps)


def test_finish_on_thread_raises_a_cancel_only_after_the_call_returned():
    finished = []

    def slow_add() -> None:
        time.sleep(0.2)
        finished.append(True)

    async def cancel_mid_call() -> list[bool]:
        task = asyncio.ensure_future(finish_on_thread(slow_add))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return list(finished)  # what the caller's cleanup would see
        raise AssertionError("the cancel was swallowed")

    assert asyncio.run(cancel_mid_call()) == [True]


def test_finish_on_thread_runs_a_call_not_yet_started_through_repeated_cancels():
    """Serve cancels a stream more than once when its client leaves; the cleanup call must still run
    even when every worker thread is busy, so it has not started when the cancels land."""
    from concurrent.futures import ThreadPoolExecutor

    ran, release = [], threading.Event()

    async def cancel_twice_before_the_call_starts() -> bool:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
        blocker = asyncio.get_running_loop().run_in_executor(None, release.wait)  # the only worker is busy
        task = asyncio.ensure_future(finish_on_thread(ran.append, "cleanup"))
        await asyncio.sleep(0.02)
        for _ in range(2):
            task.cancel()
            await asyncio.sleep(0.02)
        release.set()
        await blocker
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(cancel_twice_before_the_call_starts()) is True
    assert ran == ["cleanup"]


def test_an_idle_loop_reports_periodically_and_a_busy_one_does_not():
    """`on_idle` (the stages re-set their gauges there) runs every `idle_report_s` while there is no work,
    survives its own errors, and stays quiet while the engine steps."""
    work = threading.Event()
    reports: list[float] = []

    def on_idle() -> None:
        reports.append(time.monotonic())
        if len(reports) == 2:
            raise RuntimeError("a failing report must not stop the loop")

    loop = EngineLoop(busy_step, work.is_set, lambda err: None, "test-engine", on_idle=on_idle, idle_report_s=0.1)
    loop.start()
    try:
        time.sleep(0.55)
        idle_reports = len(reports)
        assert 3 <= idle_reports <= 7, reports
        work.set()
        time.sleep(0.1)  # the report already under way, if any, ends
        while_busy = len(reports)
        time.sleep(0.4)
        assert len(reports) == while_busy
        work.clear()
        time.sleep(0.35)
        assert len(reports) > while_busy
    finally:
        loop.stop()


def failing_loop(err: Exception, errors: list, lost: list) -> tuple[EngineLoop, list[int]]:
    """A loop whose third step raises `err`; `errors` gets what `on_error` got, `lost` the reasons
    `on_device_lost` got (the stages' default ends the process). Returns the loop and its step count."""
    steps = [0]

    def step() -> None:
        steps[0] += 1
        if steps[0] == 3:
            raise err

    loop = EngineLoop(step, lambda: True, errors.append, "test-engine", idle_wait_s=0.001, on_device_lost=lost.append)
    return loop, steps


def test_a_lost_device_stops_the_loop_fails_health_and_ends_the_replica():
    for err in (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
                RuntimeError("CUDA error: device-side assert triggered")):  # fmt: skip
        errors, lost = [], []
        loop, steps = failing_loop(err, errors, lost)
        loop.check_health()  # healthy before
        loop.start()
        time.sleep(0.1)
        assert steps == [3] and errors == []  # no step after the device error, no stream failed here
        assert len(lost) == 1 and "CUDA error" in lost[0]
        with pytest.raises(RuntimeError, match="accelerator lost"):
            loop.check_health()
        loop.stop()


def test_an_out_of_memory_step_fails_its_requests_and_the_loop_steps_on():
    oom = StepOutOfMemory(["b"], torch.OutOfMemoryError("CUDA out of memory (injected)"))
    errors, lost = [], []
    loop, steps = failing_loop(oom, errors, lost)
    loop.start()
    time.sleep(0.1)
    loop.stop()
    assert errors == [oom] and lost == [] and steps[0] > 3
    loop.check_health()


def test_on_start_runs_on_the_loop_thread_before_any_step_and_start_waits_for_it():
    seen: list[tuple[str, str]] = []

    def warm() -> None:
        time.sleep(0.05)
        seen.append(("start", threading.current_thread().name))

    loop = EngineLoop(lambda: seen.append(("step", threading.current_thread().name)), lambda: True,
                      lambda err: None, "test-engine", on_start=warm)  # fmt: skip
    loop.start()
    try:
        assert seen and seen[0] == ("start", "test-engine")  # done when start returned, on the engine's thread
        time.sleep(0.02)
        assert {name for _, name in seen} == {"test-engine"} and seen[1][0] == "step"
    finally:
        loop.stop()


def test_a_failed_on_start_fails_start_and_no_step_runs():
    steps = []

    def fail() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    loop = EngineLoop(lambda: steps.append(1), lambda: True, lambda err: None, "test-engine", on_start=fail)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        loop.start()
    time.sleep(0.02)
    assert not steps

"""EngineLoop fairness: a caller (add / cancel) never waits more than about one step."""

from __future__ import annotations

import asyncio
import threading
import time

from deployments.engine_loop import EngineLoop, finish_on_thread


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

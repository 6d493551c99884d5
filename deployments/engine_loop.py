"""A background thread that steps an engine while it has work, for the Serve replicas.

Replicas are asyncio actors; the engine step is CPU/GPU-bound, so it runs here and hands
results back to the event loop. Callers mutate the engine only inside `exclusive()`, which
waits for the current step at most: the loop lets waiting callers in before its next step (a
plain lock is unfair: the loop re-took it after every step and could starve a cancel for the
whole length of a stream). A step that fails goes to `on_error` and the loop steps on, unless the
device is lost (`llm_stage.faults.is_device_lost`): then the loop stops, `check_health` fails and
the replica's process ends, so Serve replaces it and the Router resumes its streams elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from deployments.loop_trace import LoopTrace, StepReport
from llm_stage.faults import is_device_lost, is_out_of_memory

logger = logging.getLogger(__name__)

CALLER_WINDOW_S = 0.01  # longest the loop holds back a step for callers waiting for the engine
IDLE_REPORT_S = 0.5  # an idle loop's `on_idle` period: under half Ray's shortest metric export interval (1 s)
DEVICE_LOST_EXIT_CODE = 70  # (EX_SOFTWARE) the process ended itself after a device error


async def finish_on_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on a worker thread, always run to its end. A cancel that arrives meanwhile (even
    a repeated one, as Serve sends when a client leaves) is raised only once `fn` has returned, so
    the caller's cleanup runs after the state `fn` added, and a cleanup `fn` itself is never lost.

    The call is handed to the executor before the first await, and only a shield of it is ever
    awaited: cancelling an awaited `to_thread` withdraws a call its thread has not picked up yet.
    """
    call = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    cancelled = False
    while not call.done():
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # raised below, unless the caller is gone
            break
    if cancelled:
        raise asyncio.CancelledError
    return call.result()


def end_process(reason: str) -> None:
    """End this replica's process now: its device is lost. The Router's streams from it then fail
    with RayActorError, which it answers by resuming them on another replica (`router.streams`),
    and Serve's controller replaces it at once (a failing `check_health` alone takes three health
    periods, then a graceful stop that waits for the streams). `os._exit`: no Python teardown, which
    could touch the broken CUDA context and hang; the log is flushed first."""
    logger.critical("accelerator lost (%s): ending this replica so Serve replaces it", reason)
    for handler in _all_log_handlers():
        try:
            handler.flush()
        except Exception:  # a handler that cannot flush must not keep the process alive
            pass
    os._exit(DEVICE_LOST_EXIT_CODE)


def _all_log_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return [h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers]


def replica_tag() -> str:
    """`Deployment#replica` of the calling Serve replica ("" outside Serve)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        context = serve.get_replica_context()
    except RayServeException:  # not inside a replica (unit tests, in-process use)
        return ""
    return f"{context.deployment}#{context.replica_id.unique_id}"


class EngineLoop:
    def __init__(
        self,
        step: Callable[[], StepReport | None],
        has_work: Callable[[], bool],
        on_error: Callable[[BaseException], None],
        name: str,
        idle_wait_s: float = 0.05,
        on_idle: Callable[[], None] | None = None,
        idle_report_s: float = IDLE_REPORT_S,
        on_device_lost: Callable[[str], None] = end_process,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """`on_start` runs first on the loop's thread (a warm-up: allocators keep per-thread arenas,
        so it must run where the steps will); `start` returns once it has."""
        self._lock = threading.Lock()
        self._callers = 0  # callers inside or waiting for `exclusive()`
        self._callers_lock = threading.Lock()
        self._step = step
        self._has_work = has_work
        self._on_error = on_error
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._on_idle = on_idle
        self._idle_report_s = idle_report_s
        self._last_idle_report_s = 0.0
        self.step_time_ema_s = 0.0
        self.trace = LoopTrace()  # every step's wall time and the gap before it (`loop_trace()`)
        self._on_device_lost = on_device_lost
        self.device_error: str | None = None  # set once a step lost the device: the replica is unhealthy
        self._on_start = on_start
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start stepping, once `on_start` ran (its error is raised here: the replica does not start)."""
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def wake(self) -> None:
        self._wake.set()

    def check_health(self) -> None:
        """Raise once the device was lost (the stages' Serve `check_health`: Serve then replaces the
        replica, should `on_device_lost` not have ended it)."""
        if self.device_error is not None:
            raise RuntimeError(f"accelerator lost: {self.device_error}")

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine between steps (for add / cancel from other threads)."""
        with self._callers_lock:
            self._callers += 1
        try:
            with self._lock:
                yield
        finally:
            with self._callers_lock:
                self._callers -= 1

    def _run(self) -> None:
        try:
            if self._on_start is not None:
                with self._lock:
                    self._on_start()
        except BaseException as err:
            self._start_error = err
            return
        finally:
            self._started.set()
        while not self._stopped.is_set():
            self._let_callers_in()
            with self._lock:
                busy = self._has_work()
                if busy:
                    self._timed_step()
            if not busy:
                self.trace.idled()
                self._report_idle()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()

    def _report_idle(self) -> None:
        """`on_idle` at most every `idle_report_s` while there is no work (gauges re-set: Ray drops a
        gauge series not set within two metric export intervals, so an idle replica's 0 would vanish)."""
        now = time.monotonic()
        if self._on_idle is None or now - self._last_idle_report_s < self._idle_report_s:
            return
        self._last_idle_report_s = now
        try:
            self._on_idle()
        except Exception:  # a report must never stop the engine
            logger.exception("idle report failed")

    def _let_callers_in(self) -> None:
        """Callers waiting now go before the next step, for at most CALLER_WINDOW_S: a steady
        stream of callers (chunk submits from many streams) must not starve the engine either."""
        deadline = time.perf_counter() + CALLER_WINDOW_S
        while self._callers and time.perf_counter() < deadline:
            time.sleep(0.0005)

    def _timed_step(self) -> None:
        """One step, timed: the EMA, and the trace (monotonic stamps, the step's `StepReport`)."""
        start, started_s, report = time.perf_counter(), time.monotonic(), None
        try:
            report = self._step()
        except Exception as err:
            if is_device_lost(err):  # the CUDA context is unusable: never step again here
                self._lose_device(err)
                return
            if is_out_of_memory(err):  # the step shed its requests; the engine runs on
                logger.warning("engine step out of memory: %s", err)
            else:
                logger.exception("engine step failed")
            self._on_error(err)
        elapsed = time.perf_counter() - start
        self.trace.record(started_s, started_s + elapsed, report)
        self.step_time_ema_s = elapsed if self.step_time_ema_s == 0 else 0.9 * self.step_time_ema_s + 0.1 * elapsed

    def _lose_device(self, err: BaseException) -> None:
        """Unhealthy for good, no more steps, and `on_device_lost` (which ends the process)."""
        logger.error("engine step lost the device", exc_info=err)
        self.device_error = f"{type(err).__name__}: {err}"[:300]
        self._stopped.set()
        self._on_device_lost(self.device_error)

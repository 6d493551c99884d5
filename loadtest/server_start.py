"""Starting a server process for a bench and waiting until it streams audio, shared by the sweep's
systems (`loadtest.run_all.start_ready`) and the endurance benches' `voxray serve`
(`loadtest.cluster_process.start_server`).

The wait checks the process between readiness tries, so a server that ends before it serves fails at
once with the end of its log instead of after the whole timeout. A server whose Ray timed out in its
own start (`RAY_START_TIMED_OUT`: its raylet or GCS came up late on a loaded box, seen beside a test
session's cluster) is started once more; any other early exit fails at once.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from loadtest.sweep import wait_ready

READY_POLL_S = 2.0  # readiness is tried this long at a time (at least once), the process checked between
START_ATTEMPTS = 2
RAY_START_TIMED_OUT = "timed out during startup"  # ray.init's error when its raylet or GCS came up late
LOG_TAIL_CHARS = 3000

Server = TypeVar("Server")


class ServerExited(RuntimeError):
    """The server process ended before it served; `log_tail` is the end of its log."""

    def __init__(self, code: int | None, log_tail: str) -> None:
        super().__init__(f"the server exited ({code}) before it served; its log ends:\n{log_tail}")
        self.log_tail = log_tail


def wait_serving(proc: subprocess.Popen, log_path: Path, target: str, app_name: str, timeout_s: float,
                 voice: str = "tara") -> None:  # fmt: skip
    """Until the server at `target` streams audio (`wait_ready`, `READY_POLL_S` at a time),
    `ServerExited` as soon as `proc` ends, TimeoutError after `timeout_s`."""
    deadline, last = time.monotonic() + timeout_s, ""
    while True:
        if proc.poll() is not None:
            raise ServerExited(proc.returncode, log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:])
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise TimeoutError(f"{target} not ready after {timeout_s:.0f} s ({last})")
        try:
            wait_ready(target, app_name, min(left_s, READY_POLL_S), voice=voice)
            return
        except TimeoutError as err:
            last = str(err)


def start_until_serving(launch: Callable[[], Server], wait: Callable[[Server], None],
                        stop: Callable[[Server], object], label: str = "server") -> Server:  # fmt: skip
    """`launch()` then `wait(server)`; a server whose Ray timed out in its start is stopped and launched
    once more (up to `START_ATTEMPTS` in all), any other failure stops it and raises."""
    attempt = 1
    while True:
        server = launch()
        try:
            wait(server)
            return server
        except ServerExited as err:
            stop(server)
            if attempt >= START_ATTEMPTS or RAY_START_TIMED_OUT not in err.log_tail:
                raise
        except BaseException:
            stop(server)
            raise
        print(f"{label}: Ray timed out in its start (attempt {attempt}); starting it again", flush=True)
        attempt += 1

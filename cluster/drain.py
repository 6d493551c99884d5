"""Graceful stop, driver side: drain an app, then (embedded Ray) stop Serve and Ray.

`voxray serve` calls `stop_gracefully` on SIGTERM / SIGINT; `voxray drain` (the k8s preStop
hook of the head pod) calls `drain`. Routers refuse new streams at once and end those still
playing at the deadline with UNAVAILABLE and a retry hint (`router.drain`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from router.drain import POLL_S, open_streams_by_router, start_drain

SETTLE_S = 3 * POLL_S  # the Routers' first reports arrive within a poll or two


@dataclass(frozen=True)
class DrainReport:
    drained_s: float  # from the start of the drain until no Router had a stream
    open_streams_left: int  # streams still open when the wait ended (0 = all finished or ended)


def drain(app_name: str, grace_s: float) -> DrainReport:
    """Drain `app_name`; returns once its Routers report no open stream, or a little after the deadline."""
    start_s = time.monotonic()
    deadline_unix_s = start_drain(app_name, grace_s)
    give_up_unix_s = deadline_unix_s + 2.0  # streams past the deadline end at their next chunk
    time.sleep(SETTLE_S)
    while True:
        counts = open_streams_by_router(app_name)
        left = sum(counts.values())
        if (counts and left == 0) or time.time() >= give_up_unix_s:
            return DrainReport(time.monotonic() - start_s, left)
        time.sleep(POLL_S)

"""How fast this box's cores run right now: a fixed pure-Python work unit timed on every core at once.

The 2-core CPU box is a VM whose cores' speed moves by minutes without any steal time showing: on
2026-12-06 two spinning processes ran 62-120 units a second each within 40 s, and one alone 111 then 71
(`docs/experiments/2026-12-05-capacity-planner.md`). A capacity measured at one speed and predicted from a
calibration taken at another differ by that much whatever the planner does, so `loadtest.plan_calibrate`
records the speed it calibrated at and `loadtest.plan_check` the speed around each draw, and reports
the ratio beside each capacity.
"""

from __future__ import annotations

import multiprocessing
import os
import time

WORK_ITERATIONS = 200_000  # one unit: ~9 ms on this box's cores at their usual speed
PROBE_S = 1.0


def _unit() -> int:
    total = 0
    for i in range(WORK_ITERATIONS):
        total += i * i
    return total


def units_per_s(seconds: float = PROBE_S) -> float:
    """Work units this process completes per second over `seconds` (one core's speed)."""
    start, done = time.perf_counter(), 0
    while (elapsed := time.perf_counter() - start) < seconds:
        _unit()
        done += 1
    return done / elapsed


def box_units_per_s(seconds: float = PROBE_S, cores: int | None = None) -> float:
    """Work units per second of the whole box: one probe process per core, all at once (fresh processes:
    safe beside the caller's gRPC threads), summed."""
    cores = cores or os.cpu_count() or 1
    with multiprocessing.get_context("spawn").Pool(cores) as pool:
        return float(sum(pool.map(units_per_s, [seconds] * cores)))


def speed_ratio(now: float, reference: float) -> float:
    """`now` / `reference` (1.0: the same speed; 0 when either is unknown)."""
    return now / reference if now > 0 and reference > 0 else 0.0

"""How fast this box's cores run right now: a fixed pure-Python work unit timed on every core at once.

The 2-core CPU box is a VM whose cores' speed moves by minutes without any steal time showing: on
2026-12-06 two spinning processes ran 62-120 units a second each within 40 s, and one alone 111 then 71
(`docs/experiments/2026-12-05-capacity-planner.md`). A capacity measured at one speed and predicted from a
calibration taken at another differ by that much whatever the planner does, so `loadtest.plan_calibrate`
records the speed it calibrated at and `loadtest.plan_check` the speed around each draw, and reports
the ratio beside each capacity.

The Python unit does not predict the serving loop's work: at 21:07-21:20 the same evening it read
166 / 137 / 224 / 182 units/s while the LLM step at 4 rows took 4.43 / 3.91 / 4.79 / 3.30 ms, swinging
as much but not together. So each probe also times that work itself (`box_step_ms`: the CPU preset's
LLM engine at 4 aligned rows, one torch thread, in a fresh process, the rest of the box idle).
"""

from __future__ import annotations

import multiprocessing
import os
import time

STEP_PROBE_ROWS = 4  # decode rows of the step probe (orpheus-tiny, aligned starts, one torch thread)
STEP_PROBE_TOKENS = 150  # tokens per row: ~1 s of steps
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


def step_ms() -> float:
    """This process: ms per decode step of the CPU preset's LLM engine at STEP_PROBE_ROWS rows (after a
    short warm-up run)."""
    import torch

    from core.config import ModelConfig
    from llm_stage.models.orpheus import OrpheusAdapter
    from loadtest.step_bench import ms_per_step

    torch.set_num_threads(1)
    adapter = OrpheusAdapter.build(ModelConfig(torch_threads=1))
    ms_per_step(adapter, STEP_PROBE_ROWS, 16)
    return ms_per_step(adapter, STEP_PROBE_ROWS, STEP_PROBE_TOKENS)


def box_step_ms() -> float:
    """`step_ms` in a fresh process (safe beside the caller's gRPC threads)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return float(pool.apply(step_ms))


def speed_ratio(now: float, reference: float) -> float:
    """`now` / `reference` (1.0: the same speed; 0 when either is unknown)."""
    return now / reference if now > 0 and reference > 0 else 0.0

"""The planner's simulation of one `plan_check` configuration at one rate, in the figures `loadtest.loop_stalls`
prints for the real cluster: each stage's loops busy, the host's work, the busy-weighted loops a busy one
shares the cores with, admission's mean limit and the share of the time it held a waiting stream back, and
the p90 TTFA and viability. Side by side with a `loop_stalls` run at the same rate it says where the model
and the cluster part (issue 40: the 2x2 on 2 cores met in the model and missed for real at equal contention).
No Ray. Usage: python -m loadtest.plan_trace --calibration bench_out/plan_calibration.json --config cpu-2x2 \
    --rps 2.05 [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cluster.planner.calibration import load_calibration
from cluster.planner.predict import Scenario, finish, run_llm
from cluster.planner.search import DEFAULT_MAX_STARTING
from cluster.planner.shared_cores import BIN_S
from cluster.planner.simulate import ClusterShape, SimOptions
from loadtest.plan_configs import CONFIGS, ORPHEUS_TINY, CheckConfig, sweep_workload


def trace_rate(scenario: Scenario, config: CheckConfig, rps: float, seed: int,
               min_measured: int = SimOptions.min_measured) -> dict[str, float]:  # fmt: skip
    """One simulated draw of `config` at `rps` (req/s): its outcome, load and admission over the measured
    window (until `min_measured` streams arrived in it)."""
    shape = ClusterShape(config.llm_replicas, config.detok_replicas, config.max_streams_per_replica,
                         DEFAULT_MAX_STARTING)  # fmt: skip
    options = SimOptions(seed=seed, trace_admission=True, min_measured=min_measured)
    run = run_llm(scenario, rps * scenario.workload.mean_audio_s(scenario.rates), shape, options)
    prediction = finish(scenario, run, config.detok_replicas, options)
    out = {"seed": seed, "p90_ttfa_s": prediction.p90_ttfa_s, "viable_pct": prediction.viable_pct,
           "queue_wait_p90_s": prediction.queue_wait_p90_s}  # fmt: skip
    if run.llm.admission is not None:
        out |= run.llm.admission.summary(run.window_s)
    if run.share is not None and run.share.enabled:
        out |= core_share_summary(run.share.llm_busy, run.share.detok_busy, run.share.host_cores, run.window_s)
    return out


def core_share_summary(llm_busy: np.ndarray, detok_busy: np.ndarray, host_cores: np.ndarray,
                       window_s: tuple[float, float]) -> dict[str, float]:  # fmt: skip
    """Over `window_s` on the `CoreShare` grid: each stage's mean loops busy, the host's cores, and the loops
    busy as a busy loop sees them (busy-weighted: sum of busy^2 / sum of busy)."""
    lo, hi = (int(t / BIN_S) for t in window_s)
    llm, detok, host = llm_busy[lo:hi], detok_busy[lo:hi], host_cores[lo:hi]
    both = llm + detok
    return {"llm_busy": float(llm.mean()), "detok_busy": float(detok.mean()), "host_cores": float(host.mean()),
            "busy_weighted_loops": float((both * both).sum() / max(float(both.sum()), 1e-12))}  # fmt: skip


def format_row(row: dict[str, float]) -> str:
    text = (f"seed {row['seed']}: p90 TTFA {row['p90_ttfa_s']:.2f} s, viable {row['viable_pct']:.1f}%, queue p90 "
            f"{row['queue_wait_p90_s']:.2f} s")  # fmt: skip
    if "mean_limit" in row:
        text += (f"; admission: mean limit {row['mean_limit']:.2f}, open {row['mean_open']:.2f}, full "
                 f"{100 * row['full_share']:.0f}% of the time, starts full {100 * row['starts_full_share']:.0f}%, "
                 f"held a waiting stream "
                 f"{100 * row['held_share']:.0f}%, paced by {row['mean_measured_rows']:.1f} rows keeping "
                 f"{row['mean_real_time_streams']:.1f} streams at real time")  # fmt: skip
    if "llm_busy" in row:
        text += (f"; loops busy: LLM {row['llm_busy']:.2f}, detok {row['detok_busy']:.2f}, busy-weighted "
                 f"{row['busy_weighted_loops']:.2f}; host {row['host_cores']:.3f} cores")  # fmt: skip
    return text


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, required=True, help="a JSON written by loadtest.plan_calibrate")
    parser.add_argument("--config", choices=[c.name for c in CONFIGS], default="cpu-2x2")
    parser.add_argument("--rps", type=float, required=True, help="the open-loop rate, req/s")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--min-measured", type=int, default=SimOptions.min_measured,
                        help="streams arriving in each draw's measured window")  # fmt: skip
    args = parser.parse_args(argv)
    config = next(c for c in CONFIGS if c.name == args.config)
    scenario = Scenario(load_calibration(args.calibration), ORPHEUS_TINY, sweep_workload())
    rows = []
    for seed in args.seeds:
        rows.append(trace_rate(scenario, config, args.rps, seed, args.min_measured))
        print(f"{config.name} at {args.rps} req/s, {format_row(rows[-1])}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()

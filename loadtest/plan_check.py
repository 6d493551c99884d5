"""Planner vs the real cluster on this machine: predicted and measured capacity at SLO (issue 40 item 3).

(1) Calibrate on this box now (`loadtest.plan_calibrate`, or read its JSON with --calibration): the LLM step
alone, and from a served 1x1 cluster (`loadtest.host_cost`) the serving loop's step by rows, the detok
replica's cost per chunk and the host's CPU per stream and per chunk with the idle background (the `host`
section: every stage shares the 2 cores); none of it from the check's sweeps, so nothing is fitted to the
capacities it then predicts. For each configuration: (2) predict the capacity at SLO
with `cluster.planner` on the sweep's own prompt mix (its frames per prompt, clamped as `loadtest.workload`
clamps them), each load judged on draws of `--duration-s` from an empty cluster as the sweep's (`voxray plan`'s
search with `--draw-s`), in req/s = streams / mean audio seconds; (3) measure it: `voxray serve` of the configuration
as a process (`loadtest.cluster_process`) and the sweep's open-loop rates around the prediction, each rate
decided by most of `--draws` Poisson draws (as the planner decides a load by most of its `--seeds`); (4) the
verdict: |predicted - measured| / measured <= 25%, or none where the box's speed around the draws moved
more than SPEED_TOLERANCE from the calibration's, by the Python unit or by the LLM step at 4 rows
(`loadtest.box_speed`: this VM's cores change speed by minutes, and a CPU-bound capacity with them); a draw
whose step probe was off by more runs again first (`rate_verdict`). Beside the central prediction, the
capacities at the two ends of the calibration's `host_range` (the host fit's own spread: two calibrations an
hour apart predicted cap4 a third apart), and whether the measured capacity falls between them (`in_range`).
(5) The model on the check's own draws, once the cluster is stopped: each served draw's streams replayed through
the planner (`loadtest.plan_replay`), the capacity it calls over the same swept rates and the share of draws
it calls as served. A 60 s draw offers 0.77-1.33x its nominal rate, so (3) against (2) mixes the model's error
with the draws' luck; (5) against (3) sees the same arrivals on both sides.
(6) `--fixed-draws`: one estimator on both sides (`loadtest.plan_crossing`): the rate where half of the draws meet
the SLO. The planner first runs `--planner-draws` draws at every rate of the grid, shaped as the sweep's (its
arrivals and texts from the same generator, cold start, no tail); the cluster then serves the grid's rates around
where half of those met (`rates_around`), each in exactly `--draws` draws, none run again; the verdict compares
the two crossings. (3)'s rule stops at its first unlucky rate: identical arrivals flip one time in four near
capacity, so it read low.
Starts Ray: never run it beside another benchmark.
Run (~30 min on 2 quiet cores, and each configuration's two host-range predictions before its sweep, with no
Ray running, take minutes more): .venv/bin/python -m loadtest.plan_check --out bench_out/plan_check
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.planner.calibration import load_calibration
from cluster.planner.predict import Scenario
from cluster.planner.search import Slo, capacity_streams
from cluster.planner.simulate import SimOptions
from loadtest.box_speed import speed_ratio
from loadtest.plan_configs import (
    CONFIGS,
    ORPHEUS_TINY,
    SPEED_TOLERANCE,
    CheckConfig,
    max_requests_for,
    serve_config,
    shape_of,
    sweep_workload,
)
from loadtest.plan_crossing import Crossing, half_crossing
from loadtest.plan_draws import (
    AT_DRAW_SPEED,
    Crossings,
    met_by_rate,
    planner_draws_by_rate,
    rates_around,
    replay_agreement,
    replay_steps,
    replayed_capacity,
    served_crossings,
)
from loadtest.plan_served import measure_rps, write_sweep

RATE_FACTORS = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4, 1.6)  # swept rates: x the predicted capacity


@dataclass(frozen=True)
class CheckResult:
    name: str
    predicted_rps: float
    measured_rps: float
    swept_rps: tuple[float, ...]
    others_cores: float = 0.0  # the box's cores other tenants kept busy over the sweep (`BoxCpu`)
    steal_cores: float = 0.0  # the cores the hypervisor gave other machines while ours wanted them
    # the box's speed around the draws / at calibration (`loadtest.box_speed`; 0: not probed): this VM's
    # cores change speed by minutes with no steal showing, and a capacity moves with them
    box_speed_ratio: float = 0.0
    # the same by the LLM step at 4 rows probed around the draws (calibration's ms / the draws' ms; 0: not
    # probed): the Python unit does not predict the serving loop's work
    step_speed_ratio: float = 0.0
    # (least, most) capacity predicted over the calibration's `host_range` (`predicted_range_rps`); None:
    # not predicted, read as (predicted_rps, predicted_rps)
    predicted_range_rps: tuple[float, float] | None = None
    # the planner on the check's own draws (`replay_steps`): the capacity it calls over the swept rates
    # (`replayed_capacity`; None: not replayed), whether every swept rate replayed as met (then a floor), and
    # the share of draws it called as they were served
    replayed_rps: float | None = None
    replayed_is_floor: bool = False
    replay_agreement: float | None = None
    # the same with each draw's steps at the draw's own speed (`replay_at_draw_speed`)
    replayed_at_speed_rps: float | None = None
    replayed_at_speed_is_floor: bool = False
    crossings: Crossings | None = None  # `--fixed-draws`: the capacities where half the draws meet, judged instead

    @property
    def capacity_range_rps(self) -> tuple[float, float]:
        """(least, most) capacity predicted: at the dearest host and at the cheapest."""
        return self.predicted_range_rps or (self.predicted_rps, self.predicted_rps)

    @property
    def in_range(self) -> bool:
        """The measured capacity within the predicted range (its ends included)."""
        least, most = self.capacity_range_rps
        return least <= self.measured_rps <= most

    @property
    def error(self) -> float:
        return abs(self.predicted_rps - self.measured_rps) / self.measured_rps if self.measured_rps else float("inf")

    @property
    def within_25_pct(self) -> bool:
        return self.error <= 0.25

    @property
    def is_off_speed(self) -> bool:
        """The box ran its draws at another speed than it calibrated at (more than SPEED_TOLERANCE apart):
        the capacities compare two machines, so the check gives no verdict."""
        ratios = (self.box_speed_ratio, self.step_speed_ratio)
        return any(r > 0 and abs(r - 1.0) > SPEED_TOLERANCE for r in ratios)

    @property
    def verdict(self) -> str:
        """The check's verdict: at the half crossings where judged there (`--fixed-draws`), else `majority_verdict`."""
        if self.crossings is None or self.is_off_speed:
            return self.majority_verdict
        error = self.crossings.error
        if error is None:
            return "no verdict: a crossing outside the swept rates"
        return "yes" if error <= 0.25 else "no"

    @property
    def majority_verdict(self) -> str:
        """The predicted (bisection) vs measured (majority rule) capacity within 25%."""
        if self.is_off_speed:
            return "no verdict: box off speed"
        return "yes" if self.within_25_pct else "no"


def predicted_rps(scenario: Scenario, config: CheckConfig, slo: Slo, sim: SimOptions = SimOptions()) -> float:
    shape = shape_of(config)
    streams = capacity_streams(scenario, shape, slo, high=8 * config.max_streams_per_replica * config.llm_replicas,
                               sim=sim)  # fmt: skip
    return streams / scenario.workload.mean_audio_s(scenario.rates)


def predicted_range_rps(scenario: Scenario, config: CheckConfig, slo: Slo, central_rps: float,
                        sim: SimOptions = SimOptions()) -> tuple[float, float]:  # fmt: skip
    """(least, most) capacity in req/s over the calibration's `host_range`: the prediction on its dearest
    host (`high`) and on its cheapest (`low`: more cores left to the stages, more capacity), widened to hold
    `central_rps` (the simulation's seed luck could leave it outside); (central, central) without a range."""
    spread = scenario.calib.host_range
    if spread is None:
        return central_rps, central_rps
    at_ends = [predicted_rps(scenario.with_host(host), config, slo, sim) for host in (spread.high, spread.low)]
    return min(*at_ends, central_rps), max(*at_ends, central_rps)


def swept_rates(predicted: float, factors: tuple[float, ...] = RATE_FACTORS) -> tuple[float, ...]:
    return tuple(round(max(0.05, predicted * factor), 3) for factor in factors)


def check(
    config: CheckConfig, scenario: Scenario, slo: Slo, out: Path, duration_s: float,
    factors: tuple[float, ...] = RATE_FACTORS, sim: SimOptions = SimOptions(), draws: int = 1,
    calibration_speed: float = 0.0, calibration_step_ms: float = 0.0, planner_draws: int = 0, workers: int = 1,
) -> CheckResult:  # fmt: skip
    """One configuration predicted, served and replayed. `planner_draws` > 0 (`--fixed-draws`): the planner's
    sweep-shaped draws at every rate of the grid first (`planner_draws` each, no cluster running), then the served
    rates around where half of them meet (`rates_around`), each in exactly `draws` draws; judged at the crossings."""
    predicted = predicted_rps(scenario, config, slo, sim)
    spread = predicted_range_rps(scenario, config, slo, predicted, sim)
    rates = swept_rates(predicted, factors)
    crossings, served_rates, planner_by_rate = None, rates, {}
    if planner_draws > 0:
        planner_by_rate = planner_draws_by_rate(scenario, config, slo, sim, rates, duration_s, planner_draws, workers)
        served_rates = rates_around(rates, half_crossing(met_by_rate(planner_by_rate)))
    measured = measure_rps(config, served_rates, slo, out, duration_s, draws, calibration_step_ms, planner_draws > 0,
                           max_requests=max_requests_for(rates, duration_s))  # fmt: skip
    replay_steps(measured.steps, scenario, config, slo, sim, calibration_step_ms, workers)
    if planner_draws > 0:
        crossings = served_crossings(measured.steps, scenario, config, slo, sim, duration_s, rates,
                                     planner_by_rate, (draws, planner_draws), calibration_step_ms, workers,
                                     out / config.name / "planner_draws.json")  # fmt: skip
    write_sweep(config, out, draws, measured)
    replayed, is_floor = replayed_capacity(measured.steps)
    at_speed, at_speed_is_floor = replayed_capacity(measured.steps, AT_DRAW_SPEED)
    return CheckResult(config.name, predicted, measured.capacity_rps, rates, measured.others_cores,
                       measured.steal_cores, speed_ratio(measured.box_speed, calibration_speed),
                       speed_ratio(calibration_step_ms, measured.step_ms), spread, replayed, is_floor,
                       replay_agreement(measured.steps),
                       at_speed if any(AT_DRAW_SPEED in s for s in measured.steps) else None,
                       at_speed_is_floor, crossings)  # fmt: skip


def report(results: list[CheckResult]) -> list[str]:
    """The check's table: the verdict on the central prediction, the host range's least-most capacity beside it."""
    lines = ["| config | predicted req/s | least-most req/s over host_range | measured req/s | error | within 25% "
             "| in range | planner on the draws' own arrivals, req/s | the same at the draws' speed, req/s "
             "| draws called as served | other tenants' cores | stolen cores | box speed / calibration's "
             "| LLM step speed / calibration's |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        speed, step = (f"{ratio:.2f}" if ratio > 0 else "-" for ratio in (r.box_speed_ratio, r.step_speed_ratio))
        least, most = r.capacity_range_rps
        lines.append(f"| {r.name} | {r.predicted_rps:.2f} | {least:.2f}-{most:.2f} | {r.measured_rps:.2f} | "
                     f"{100 * r.error:.0f}% | {r.majority_verdict} | {'yes' if r.in_range else 'no'} | "
                     f"{replayed_cell(r.replayed_rps, r.replayed_is_floor)} | "
                     f"{replayed_cell(r.replayed_at_speed_rps, r.replayed_at_speed_is_floor)} | "
                     f"{'-' if r.replay_agreement is None else f'{100 * r.replay_agreement:.0f}%'} | "
                     f"{r.others_cores:.2f} | {r.steal_cores:.2f} | {speed} | {step} |")  # fmt: skip
    return lines


def crossing_report(results: list[CheckResult]) -> list[str]:
    """`--fixed-draws`' table: each side's capacity where half its draws meet the SLO, over the same swept rates."""
    crossed = [r for r in results if r.crossings is not None]
    if not crossed:
        return []
    lines = ["", "| config | planner's bisection req/s | planner at half, its own sweep-shaped draws "
             "| measured at half | error | within 25% | planner's draws at the served draws' speed | error "
             "| planner at half on the served draws | the same at the draws' speed "
             "| draws per rate: served / planner |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in crossed:
        c = r.crossings
        cells = [r.name, f"{r.predicted_rps:.2f}", _cell(c.planner), _cell(c.measured), _percent(c.error), r.verdict,
                 _cell(c.planner_at_speed), _percent(c.error_at_speed), _cell(c.replay), _cell(c.replay_at_speed),
                 f"{c.served_draws} / {c.planner_draws}"]  # fmt: skip
        lines.append(f"| {' | '.join(cells)} |")
    return lines


def _percent(error: float | None) -> str:
    return "-" if error is None else f"{100 * error:.0f}%"


def _cell(crossing: Crossing | None) -> str:
    return "-" if crossing is None else crossing.cell()


def replayed_cell(rps: float | None, is_floor: bool) -> str:
    """A replayed capacity as the table shows it: '-' not replayed, '>= x' a floor."""
    return "-" if rps is None else f"{'>= ' if is_floor else ''}{rps:.2f}"


def result_json(result: CheckResult) -> dict:
    """One configuration's line of plan_check.json: its fields, the range as predicted, error and in_range."""
    return {**asdict(result), "predicted_range_rps": list(result.capacity_range_rps), "error": result.error,
            "in_range": result.in_range}  # fmt: skip


def predicted_line(scenario: Scenario, config: CheckConfig, slo: Slo, sim: SimOptions) -> str:
    """`--predict-only`'s line for one configuration: the central capacity and the host range's least-most."""
    predicted = predicted_rps(scenario, config, slo, sim)
    least, most = predicted_range_rps(scenario, config, slo, predicted, sim)
    spread = "" if scenario.calib.host_range is not None else " (no host_range in the calibration)"
    return f"{config.name}: predicted {predicted:.2f} req/s, {least:.2f}-{most:.2f} over the host range{spread}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/plan_check"))
    parser.add_argument("--configs", nargs="+", default=[c.name for c in CONFIGS], help="which of CONFIGS")
    parser.add_argument("--ttfa-p90-s", type=float, default=1.0, help="the CPU sweep's SLO (BENCHMARKS)")
    parser.add_argument("--duration-s", type=float, default=30.0, help="seconds of arrivals per swept rate")
    parser.add_argument("--predict-only", action="store_true", help="calibrate and predict; sweep no cluster")
    parser.add_argument(
        "--no-host",
        action="store_true",
        help="skip the served c=1 calibration (no Ray): every stage as if on its own core",
    )
    parser.add_argument("--host-requests", type=int, default=12, help="streams in each of host_cost's two sets")
    parser.add_argument("--cores", type=int, default=2, help="the cores every process of the box shares")
    parser.add_argument("--seeds", type=int, default=0,
                        help="Poisson draws per simulated load: the capacity is the most met in most (0: as "
                             "`voxray plan`, as many as hold 2,000 arrivals, at most 13)")  # fmt: skip
    parser.add_argument("--draws", type=int, default=3,
                        help="Poisson draws per swept rate: a rate is met when most of its draws are")  # fmt: skip
    parser.add_argument("--rate-factors", type=float, nargs="+", default=list(RATE_FACTORS),
                        help="swept rates, x the predicted capacity (lower ones where it over-predicts)")  # fmt: skip
    parser.add_argument("--fixed-draws", action="store_true",
                        help="every swept rate in exactly --draws draws (none run again), judged where half of each "
                             "side's draws meet the SLO (loadtest.plan_crossing)")  # fmt: skip
    parser.add_argument("--planner-draws", type=int, default=16,
                        help="with --fixed-draws: the planner's sweep-shaped draws per swept rate")  # fmt: skip
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a JSON written by loadtest.plan_calibrate (default: calibrate now)")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    scenario = Scenario(_calibration(args), ORPHEUS_TINY, sweep_workload())
    slo = Slo(args.ttfa_p90_s)
    chosen = [c for c in CONFIGS if c.name in args.configs]
    sim = SimOptions(seeds=args.seeds, draw_s=args.duration_s)  # the planner judges a load on draws as the sweep's
    if args.predict_only:
        for config in chosen:
            print(predicted_line(scenario, config, slo, sim))
        return
    factors = tuple(sorted(args.rate_factors))
    probed = json.loads((args.out / "calibration.json").read_text()).get("box_speed", {})
    speed, step_ms = probed.get("units_per_s", 0.0), probed.get("step_ms", 0.0)
    planner_draws = args.planner_draws if args.fixed_draws else 0
    results = [check(config, scenario, slo, args.out, args.duration_s, factors, sim, args.draws, speed, step_ms,
                     planner_draws, args.cores) for config in chosen]  # fmt: skip
    summary = {"calibration": str(args.out / "calibration.json"),
               "results": [result_json(r) for r in results]}  # fmt: skip
    (args.out / "plan_check.json").write_text(json.dumps(summary, indent=2, default=float))
    print("\n".join(report(results) + crossing_report(results)))
    print(f"files in {args.out}")
    if any(r.verdict == "no" for r in results):
        raise SystemExit(1)
    if any(r.is_off_speed for r in results):
        print(f"box off speed (more than {SPEED_TOLERANCE:.0%} from the calibration's) for "
              f"{', '.join(r.name for r in results if r.is_off_speed)}: recalibrate and check again")  # fmt: skip


def _calibration(args: argparse.Namespace):  # -> Calibration
    """The calibration the check predicts with: `--calibration`'s file, else measured now
    (`loadtest.plan_calibrate`); either way copied to the output folder as calibration.json."""
    if args.calibration is not None:
        data = json.loads(args.calibration.read_text())
    else:
        from loadtest.plan_calibrate import calibrate

        data, cost = calibrate(serve_config(CONFIGS[0], 19312, 19313), args.out / "host_cost", args.cores,
                               args.host_requests, use_host=not args.no_host,
                               idle_cfg=serve_config(CONFIGS[1], 19312, 19313))  # fmt: skip
        if cost is not None:
            (args.out / "host_cost.json").write_text(json.dumps(asdict(cost), indent=2))
    (args.out / "calibration.json").write_text(json.dumps(data, indent=2))
    return load_calibration(args.out / "calibration.json")


if __name__ == "__main__":
    main()

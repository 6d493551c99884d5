"""Planner vs the real cluster on this machine: predicted and measured capacity at SLO (issue 40 item 3).

For each configuration: (1) calibrate on this box now, into a copy of `cpu-orpheus-tiny.json`: the LLM
step alone (`loadtest.step_bench.ms_per_step`, the CPU preset, aligned starts), and from a served 1x1
cluster at c=1 (`loadtest.host_cost`) the serving loop's cost per token over that step
(`pipeline_step_factor`), the detok replica's cost per chunk over the table's, and the host's CPU per stream
and per chunk with the idle background (the `host` section: every stage shares the 2 cores); none of it
from a run at load, so nothing is fitted to the capacities it then predicts; (2) predict the capacity at SLO
with `cluster.planner` on the sweep's own prompt mix (its frames per prompt, clamped as `loadtest.workload`
clamps them), in req/s = streams / mean audio seconds; (3) measure it: `voxray serve` of the configuration
as a process (`loadtest.cluster_process`) and `loadtest.sweep` at rates around the prediction; (4) the
verdict: |predicted - measured| / measured <= 25%. Starts Ray: never run it beside another benchmark.
Run (~30 min on 2 quiet cores): .venv/bin/python -m loadtest.plan_check --out bench_out/plan_check
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cluster.planner.calibration import CALIBRATION_DIR, parse_calibration
from cluster.planner.predict import Scenario
from cluster.planner.search import DEFAULT_MAX_STARTING, Slo, capacity_streams
from cluster.planner.simulate import ClusterShape, SimOptions
from cluster.planner.workload import ModelRates, Workload
from loadtest.host_cost import HostCost, calibration_host
from loadtest.workload import MAX_FRAMES, MIN_FRAMES, load_prompts

CPU_CALIBRATION = CALIBRATION_DIR / "cpu-orpheus-tiny.json"
ORPHEUS_TINY = ModelRates(24000 / 2048, 7)
RATE_FACTORS = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4, 1.6)  # swept rates: x the predicted capacity
CALIBRATION_ROWS = (1, 2, 4, 8, 12)


@dataclass(frozen=True)
class CheckConfig:
    """One configuration: replicas per stage and the admission cap (the 2 cores every process shares are
    the calibration's `host` section)."""

    name: str
    llm_replicas: int
    detok_replicas: int
    max_streams_per_replica: int


CONFIGS = (
    CheckConfig("cpu-1x1", 1, 1, 12),  # deployments/configs/cpu.yaml as loadtest.serve_voxray serves it
    CheckConfig("cpu-2x2", 2, 2, 12),  # loadtest.cluster_process.two_replica_config
    CheckConfig("cpu-1x1-cap4", 1, 1, 4),  # admission as the bottleneck
)


@dataclass(frozen=True)
class CheckResult:
    name: str
    predicted_rps: float
    measured_rps: float
    swept_rps: tuple[float, ...]

    @property
    def error(self) -> float:
        return abs(self.predicted_rps - self.measured_rps) / self.measured_rps if self.measured_rps else float("inf")

    @property
    def within_25_pct(self) -> bool:
        return self.error <= 0.25


def measured_step_ms(rows: tuple[int, ...] = CALIBRATION_ROWS, max_tokens: int = 200) -> dict[int, float]:
    """The CPU preset's decode step on this box now, by rows (what `loadtest.step_bench` prints)."""
    import torch

    from core.config import ModelConfig
    from llm_stage.models.orpheus import OrpheusAdapter
    from loadtest.step_bench import ms_per_step

    torch.set_num_threads(1)
    adapter = OrpheusAdapter.build(ModelConfig(torch_threads=1))
    return {n: ms_per_step(adapter, n, max_tokens, align_starts=True) for n in rows}


def calibration_with_steps(base: dict, step_ms_by_rows: dict[int, float], source: str) -> dict:
    """A copy of `base` whose LLM step table is `step_ms_by_rows` (one cache column), source noted."""
    data = copy.deepcopy(base)
    rows = sorted(step_ms_by_rows)
    column = data["llm"]["step_ms"]["cache_tokens"]
    data["llm"]["step_ms"] = {"rows": rows, "cache_tokens": column, "ms": [[step_ms_by_rows[n]] for n in rows]}
    data["sources"]["llm.step_ms"] = source
    return data


def sweep_workload() -> Workload:
    """The sweep's prompts, their frames clamped as the sweep clamps each request's max_tokens."""
    chars = tuple(len(text) for text in load_prompts())
    return Workload(text_chars=chars, min_frames=MIN_FRAMES, max_frames=MAX_FRAMES)


def predicted_rps(scenario: Scenario, config: CheckConfig, slo: Slo, sim: SimOptions = SimOptions()) -> float:
    shape = ClusterShape(config.llm_replicas, config.detok_replicas, config.max_streams_per_replica,
                         DEFAULT_MAX_STARTING)  # fmt: skip
    streams = capacity_streams(scenario, shape, slo, high=8 * config.max_streams_per_replica * config.llm_replicas,
                               sim=sim)  # fmt: skip
    return streams / scenario.workload.mean_audio_s(scenario.rates)


def serving_loop_line(step_ms_by_rows: dict[int, float]) -> tuple[float, float] | None:
    """(ms at 0 rows, ms per row): a least-squares line through the serving loop's step by rows (each size
    a median of its recent steps, noisy alone); None with fewer than 3 sizes measured."""
    if len(step_ms_by_rows) < 3:
        return None
    rows = np.asarray(list(step_ms_by_rows), np.float64)
    slope, intercept = np.polyfit(rows, np.asarray(list(step_ms_by_rows.values())), 1)
    return max(0.0, float(intercept)), max(0.0, float(slope))


def calibration_with_host(data: dict, cost: HostCost, cores: int, source: str) -> dict:
    """A copy of `data` (its step table measured alone on this box) with what the served cluster measured
    (`cost`): the LLM step as the serving loop measured it by rows under closed-loop load, as a line (it adds
    per row what the engine alone does not: the policy, chunk cutting, the replica's other threads), else
    the engine's table x the serving loop's CPU per token at one row over it; the detok table scaled to the
    replica's CPU per chunk at c=1; and the host's CPU at c=1 as the `host` section."""
    out = copy.deepcopy(data)
    calib = parse_calibration(data)
    one_row_ms = float(calib.llm_step.step_ms(np.ones(1), np.full(1, float(calib.llm_step.cache_tokens[0])))[0])
    sources = out["sources"]
    line = serving_loop_line(cost.loaded_step_ms_by_rows)
    if line is not None:
        base_ms, per_row_ms = line
        top = max(calib.max_streams_per_replica, max(cost.loaded_step_ms_by_rows))
        column = out["llm"]["step_ms"]["cache_tokens"]
        ends_ms = [[round(base_ms + per_row_ms * rows, 3)] for rows in (1, top)]
        out["llm"]["step_ms"] = {"rows": [1, top], "cache_tokens": column, "ms": ends_ms}
        out["llm"]["pipeline_step_factor"] = 1.0
        table = data["llm"]["step_ms"]
        alone = ", ".join(f"{r}: {ms[0]:.2f}" for r, ms in zip(table["rows"], table["ms"], strict=True))
        sources["llm.step_ms"] = (f"{source}: the LLM replica's serving-loop step by rows under closed-loop load "
                                  f"(its own medians), fitted {base_ms:.2f} + {per_row_ms:.2f} ms a row; the engine "
                                  f"alone (step_bench) {alone} ms")  # fmt: skip
    else:
        out["llm"]["pipeline_step_factor"] = round(max(1.0, cost.llm_ms_per_token / one_row_ms), 3)
        sources["llm.pipeline_step_factor"] = (
            f"{source}: the LLM replica's CPU per token at one row "
            f"{cost.llm_ms_per_token:.2f} ms / the step alone {one_row_ms:.2f} ms"
        )
    table_ms = float(np.mean(calib.detok.batch_ms(np.asarray(cost.detok_windows, np.float64))))
    detok_factor = cost.detok_ms_per_chunk / table_ms if table_ms > 0 else 1.0
    out["detok"]["ms"] = [round(ms * detok_factor, 3) for ms in data["detok"]["ms"]]
    out["host"] = calibration_host(cost, cores)
    sources["detok"] = (
        f"{data['sources'].get('detok', '')}; scaled x{detok_factor:.2f} to the detok replica's "
        f"CPU per chunk, {cost.detok_ms_per_chunk:.1f} ms ({source})"
    )
    out["sources"]["host"] = f"{source}: CPU of every other process of the server and the client, c=1, two prompt sets"
    return out


def swept_rates(predicted: float, factors: tuple[float, ...] = RATE_FACTORS) -> tuple[float, ...]:
    return tuple(round(max(0.05, predicted * factor), 3) for factor in factors)


def serve_config(config: CheckConfig, grpc_port: int, http_port: int):  # -> ServeConfig
    from loadtest.cluster_process import two_replica_config
    from loadtest.serve_voxray import loadtest_config

    two = config.llm_replicas == 2
    base = two_replica_config(grpc_port, http_port) if two else loadtest_config(grpc_port, http_port)
    admission = base.admission.model_copy(update={"max_streams_per_replica": config.max_streams_per_replica})
    return base.model_copy(update={"admission": admission})


def measure_rps(config: CheckConfig, rates: tuple[float, ...], slo: Slo, out: Path, duration_s: float) -> float:
    """Serve the configuration and sweep `rates`; its capacity at SLO (req/s)."""
    from loadtest.cluster_process import running_server
    from loadtest.sweep import SweepConfig, run_sweep, write_result

    sweep_config = SweepConfig(
        rates_rps=rates, duration_s=duration_s, slo_ttfa_p90_s=slo.ttfa_p90_s, min_pct_viable=slo.min_viable_pct,
        max_requests=int(duration_s * max(rates)) + 8,
    )  # fmt: skip
    with running_server(serve_config(config, 19310, 19311), out / config.name) as server:
        result = run_sweep(server.grpc_target, sweep_config, label=config.name)
    write_result(result, out / config.name)
    return result.capacity_rps


def check(
    config: CheckConfig, scenario: Scenario, slo: Slo, out: Path, duration_s: float,
    factors: tuple[float, ...] = RATE_FACTORS,
) -> CheckResult:  # fmt: skip
    predicted = predicted_rps(scenario, config, slo)
    rates = swept_rates(predicted, factors)
    measured = measure_rps(config, rates, slo, out, duration_s)
    return CheckResult(config.name, predicted, measured, rates)


def report(results: list[CheckResult]) -> list[str]:
    lines = ["| config | predicted req/s | measured req/s | error | within 25% |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.predicted_rps:.2f} | {r.measured_rps:.2f} | {100 * r.error:.0f}% | "
                     f"{'yes' if r.within_25_pct else 'no'} |")  # fmt: skip
    return lines


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
    parser.add_argument("--rate-factors", type=float, nargs="+", default=list(RATE_FACTORS),
                        help="swept rates, x the predicted capacity (lower ones where it over-predicts)")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = measured_step_ms()
    base = json.loads(CPU_CALIBRATION.read_text())
    data = calibration_with_steps(base, steps, f"loadtest.step_bench.ms_per_step on this box, rows {CALIBRATION_ROWS}")
    if not args.no_host:
        from loadtest.host_cost import measure
        from loadtest.host_cost import report as host_report

        cost = measure(serve_config(CONFIGS[0], 19312, 19313), args.out / "host_cost", args.host_requests)
        (args.out / "host_cost.json").write_text(json.dumps(asdict(cost), indent=2))
        print(host_report(cost))
        data = calibration_with_host(data, cost, args.cores, "loadtest.host_cost on this box")
    (args.out / "calibration.json").write_text(json.dumps(data, indent=2))
    scenario = Scenario(parse_calibration(data), ORPHEUS_TINY, sweep_workload())
    slo = Slo(args.ttfa_p90_s)
    chosen = [c for c in CONFIGS if c.name in args.configs]
    if args.predict_only:
        for config in chosen:
            print(f"{config.name}: predicted {predicted_rps(scenario, config, slo):.2f} req/s")
        return
    factors = tuple(sorted(args.rate_factors))
    results = [check(config, scenario, slo, args.out, args.duration_s, factors) for config in chosen]
    summary = {"step_ms": steps, "results": [{**asdict(r), "error": r.error} for r in results]}
    (args.out / "plan_check.json").write_text(json.dumps(summary, indent=2, default=float))
    print("\n".join(report(results)))
    print(f"mean step ms by rows: { {k: round(v, 2) for k, v in steps.items()} }; files in {args.out}")
    if not all(r.within_25_pct for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

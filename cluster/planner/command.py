"""What `voxray plan` asks and prints: a checked request -> sized (or given) clusters -> a text table.

`cluster.cli` builds a `PlanRequest` from its flags and prints `plan_report(request)`; every bad value
raises `InvalidArgumentError` naming the flag's field, so the CLI answers with one line, never a traceback.
A calibration with a `host_range` adds one line: the same plans on its cheapest and on its dearest host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cluster.planner.calibration import CALIBRATION_DIR, Calibration, find_calibration, load_calibration
from cluster.planner.predict import Scenario, predict
from cluster.planner.search import (
    AUTO_ARRIVALS,
    DEFAULT_MAX_STARTING,
    MAX_AUTO_DRAWS,
    Plan,
    SearchOptions,
    Slo,
    real_time_rows,
    size_cluster,
    zero_load_ttfa_s,
)
from cluster.planner.simulate import ClusterShape, SimOptions
from cluster.planner.workload import ModelRates, Workload
from core.errors import InvalidArgumentError

SWEEP_STREAMS = (10, 30, 100, 300, 1000, 3000, 10000)
# a draw: 90 s of arrivals from an empty cluster, as `loadtest.sweep` measures a rate (`--duration-s 90` in
# `loadtest.plan_check`, whose crossings the planner met within 25% on this shape: BENCHMARKS)
DEFAULT_DRAW_S = 90.0


@dataclass(frozen=True)
class PlanRequest:
    model: str
    gpu: str
    streams: int
    ttfa_p90_s: float
    min_viable_pct: float = 99.0
    sweep: tuple[int, ...] = ()  # non-empty: each of these stream counts instead of `streams`
    llm_replicas: int | None = None  # both given: predict this cluster (at each load) instead of sizing one
    detok_replicas: int | None = None
    text_chars: tuple[int, ...] = Workload.text_chars
    step_scale: float = 1.0
    seed: int = 0
    seeds: int = 0  # Poisson draws per load when sizing: a load meets the SLO in most (0: `search.draws_for`'s)
    draw_s: float = DEFAULT_DRAW_S  # each draw's seconds of arrivals from an empty cluster (0: a steady window)
    calibration: Path | None = None  # a calibration file instead of --gpu / --model's bundled one
    max_starting: int = DEFAULT_MAX_STARTING  # admission.max_starting_per_replica (0: no start limit)

    def check(self) -> None:
        _positive("streams", self.streams)
        _positive("ttfa_p90_s", self.ttfa_p90_s)
        _positive("step_scale", self.step_scale)
        if self.seeds < 0:
            raise InvalidArgumentError("seeds", f"must be >= 0 (0: draws for {AUTO_ARRIVALS} arrivals), got "
                                                f"{self.seeds}")  # fmt: skip
        if self.draw_s < 0:
            raise InvalidArgumentError("draw_s", f"must be >= 0 (0: a steady window), got {self.draw_s}")
        if self.max_starting < 0:
            raise InvalidArgumentError("max_starting", f"must be >= 0 (0: no start limit), got {self.max_starting}")
        if not 0 < self.min_viable_pct <= 100:
            raise InvalidArgumentError("min_viable_pct", f"must be in (0, 100], got {self.min_viable_pct}")
        for streams in self.sweep:
            _positive("sweep_streams", streams)
        for chars in self.text_chars:
            _positive("text_chars", chars)
        if (self.llm_replicas is None) != (self.detok_replicas is None):
            raise InvalidArgumentError("llm_replicas", "give both --llm-replicas and --detok-replicas, or neither")
        if self.llm_replicas is not None:
            _positive("llm_replicas", self.llm_replicas)
            _positive("detok_replicas", self.detok_replicas)


def _positive(field: str, value: float | None) -> None:
    if value is None or value <= 0:
        raise InvalidArgumentError(field, f"must be > 0, got {value}")


def scenario_for(request: PlanRequest) -> Scenario:
    """The calibration (bundled or given), the family's audio clock from the model registry, the texts."""
    from llm_stage.registry import FAMILY_MODULES, load_family

    if request.calibration is not None:
        calib = load_calibration(request.calibration)
    else:
        calib = find_calibration(request.gpu, request.model)
    if calib.family not in FAMILY_MODULES:
        raise InvalidArgumentError("family", f"calibration names unknown family {calib.family!r}")
    family = load_family(calib.family)
    rates = ModelRates(family.frame_rate_hz, family.lm.steps_per_frame)
    return Scenario(calib, rates, Workload(text_chars=request.text_chars))


def plan_report(request: PlanRequest, progress: Callable[[Plan], None] | None = None) -> list[str]:
    """The report's lines; `progress` is told each load's plan as it is found (a sweep takes minutes)."""
    request.check()
    scenario = scenario_for(request)
    slo = Slo(request.ttfa_p90_s, request.min_viable_pct)
    sim = SimOptions(seed=request.seed, step_scale=request.step_scale, seeds=request.seeds, draw_s=request.draw_s)
    lines = header(scenario, request, slo, sim)
    plans = plans_for(scenario, request, slo, sim, progress)
    return lines + table(plans, slo) + host_range_lines(scenario, request, slo, sim)


def plans_for(scenario: Scenario, request: PlanRequest, slo: Slo, sim: SimOptions,
              progress: Callable[[Plan], None] | None = None) -> list[Plan]:  # fmt: skip
    """At each load: the given cluster predicted (where its bottleneck moves), else the cluster sized."""
    loads = request.sweep or (request.streams,)
    plans = []
    for streams in loads:
        if request.llm_replicas is not None:
            shape = ClusterShape(request.llm_replicas, request.detok_replicas, scenario.calib.max_streams_per_replica,
                                 request.max_starting)  # fmt: skip
            plan = Plan(streams, shape.llm_replicas, shape.detok_replicas, predict(scenario, streams, shape, sim))
        else:
            options = SearchOptions(sim=sim, max_starting_per_replica=request.max_starting)
            plan = size_cluster(scenario, streams, slo, options)
        plans.append(plan)
        if progress is not None:
            progress(plan)
    return plans


def host_range_lines(scenario: Scenario, request: PlanRequest, slo: Slo, sim: SimOptions) -> list[str]:
    """Where the calibration has a `host_range`, one line: the plans again on its cheapest host (the most
    capacity) and on its dearest (the least), as GPUs sized or, for a given cluster, p90 TTFA at each load."""
    spread = scenario.calib.host_range
    if spread is None:
        return []
    cheapest, dearest = (plans_for(scenario.with_host(host), request, slo, sim) for host in (spread.low, spread.high))
    loads = " / ".join(str(plan.streams) for plan in cheapest)
    return [
        f"host_range (the calibration's measured host spread), at {loads} streams: "
        f"cheapest host {_range_cell(cheapest, request, slo)}, dearest host {_range_cell(dearest, request, slo)}"
    ]


def _range_cell(plans: list[Plan], request: PlanRequest, slo: Slo) -> str:
    if request.llm_replicas is None:
        return " / ".join(str(plan.gpus) for plan in plans) + " GPUs"
    ttfa = " / ".join(f"{plan.prediction.p90_ttfa_s:.3f}" for plan in plans)
    met = " / ".join("met" if plan.prediction.meets(slo.ttfa_p90_s, slo.min_viable_pct) else "MISSED" for plan in plans)
    return f"p90 TTFA {ttfa} s ({met})"


def header(scenario: Scenario, request: PlanRequest, slo: Slo, sim: SimOptions) -> list[str]:
    calib = scenario.calib
    source = request.calibration or CALIBRATION_DIR / f"{calib.gpu}-{calib.model}.json"
    audio_s = scenario.workload.mean_audio_s(scenario.rates)
    return [
        f"voxray plan: {calib.model} on {calib.gpu} ({calib.device})",
        f"SLO: p90 TTFA <= {slo.ttfa_p90_s:.3f} s and >= {slo.min_viable_pct:g}% of streams viable; "
        f"streams of {audio_s:.1f} s of audio on average (Poisson arrivals, rate = streams / {audio_s:.1f} s)",
        f"calibration: {source}",
        draw_line(sim, sizing=request.llm_replicas is None),
        f"zero-load TTFA {zero_load_ttfa_s(scenario, sim):.3f} s; real-time rows per LLM replica "
        f"{real_time_rows(scenario, sim)} of {calib.max_streams_per_replica} slots; "
        f"{request.max_starting or 'any number of'} streams starting at once per replica; 1 replica = 1 GPU"
        + (f"; every LLM step x{request.step_scale:g}" if request.step_scale != 1.0 else ""),
    ]


def draw_line(sim: SimOptions, sizing: bool = True) -> str:
    """How a load is judged: how many draws must meet (a given cluster: one draw a load), and their shape."""
    if not sizing:
        draws = "1 Poisson draw per load"
    elif sim.seeds == 0:
        draws = (f"Poisson draws per load holding >= {AUTO_ARRIVALS} arrivals together (at most {MAX_AUTO_DRAWS}; "
                 "most must meet)")  # fmt: skip
    else:
        many = sim.seeds > 1
        draws = f"{sim.seeds} Poisson draw{'s' if many else ''} per load ({'most' if many else 'it'} must meet)"
    if sim.draw_s > 0:
        return f"{draws}, each {sim.draw_s:g} s of arrivals from an empty cluster, all measured (as the load test)"
    return f"{draws}, each a steady window (warm-up, >= {sim.min_measured} arrivals measured, a tail)"


COLUMNS = ("streams", "LLM", "detok", "GPUs", "streams/GPU", "p50 TTFA s", "p90 TTFA s", "viable %", "refused %",
           "LLM load", "detok load", "slots used", "bottleneck", "SLO")  # fmt: skip


def table(plans: list[Plan], slo: Slo) -> list[str]:
    rows = [COLUMNS] + [_row(plan, slo) for plan in plans]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]


def _row(plan: Plan, slo: Slo) -> tuple[str, ...]:
    p = plan.prediction
    met = "met" if p.meets(slo.ttfa_p90_s, slo.min_viable_pct) else "MISSED"
    return (
        str(plan.streams), str(plan.llm_replicas), str(plan.detok_replicas), str(plan.gpus),
        f"{plan.streams_per_gpu:.1f}", f"{p.p50_ttfa_s:.3f}", f"{p.p90_ttfa_s:.3f}", f"{p.viable_pct:.1f}",
        f"{p.rejected_pct:.1f}", f"{p.llm_load:.2f}", f"{p.detok_load:.2f}", f"{p.slot_use:.2f}", p.bottleneck, met,
    )  # fmt: skip


def describe_calibration(calib: Calibration) -> list[str]:
    """Where each figure came from (for the diary / `--sources`)."""
    return [f"  {key}: {value}" for key, value in calib.sources.items()]

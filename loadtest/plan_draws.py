"""The planner's side of `loadtest.plan_check`, on draws: each served draw's own arrivals replayed through the
planner (`replay_steps`, at the calibration's speed and at the draw's), the planner's own sweep-shaped draws at each
swept rate (`planner_draws_by_rate`), the rates the cluster then serves around where half of those met
(`rates_around`), and every side's capacity where half its draws meet the SLO (`served_crossings`). Simulation
only (no Ray): run with the cluster stopped, over worker processes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.planner.predict import Scenario
from cluster.planner.search import Slo
from cluster.planner.simulate import SimOptions
from loadtest.plan_configs import CheckConfig, max_requests_for, shape_of
from loadtest.plan_crossing import Crossing, capacity_by_majority, half_crossing, relative_error, verdicts_by_rate


@dataclass(frozen=True)
class Crossings:
    """Each side's capacity as the rate where half its draws meet the SLO, over the same swept rates
    (`plan_crossing`; `--fixed-draws`): the served draws, the planner on sweep-shaped draws of its own, the planner
    on the served draws' own arrivals at the calibration's speed and at each draw's."""

    measured: Crossing | None
    planner: Crossing | None
    replay: Crossing | None = None
    replay_at_speed: Crossing | None = None
    served_draws: int = 0  # the served draws per swept rate
    planner_draws: int = 0  # the planner's draws per swept rate
    # the planner's own draws at the served rates, each rate's steps at the speed its served draws ran at
    planner_at_speed: Crossing | None = None

    @property
    def error(self) -> float | None:
        """|planner - measured| / measured where both cross inside the swept rates."""
        return relative_error(self.planner, self.measured)

    @property
    def error_at_speed(self) -> float | None:
        return relative_error(self.planner_at_speed, self.measured)


REPLAY, AT_DRAW_SPEED = "replay", "replay_at_draw_speed"  # a draw's replays: at the calibration's speed, at its own


def draw_speed_scale(step: dict, calibration_step_ms: float) -> float:
    """How much slower (> 1) or faster the box ran a draw than it calibrated, by the LLM step probed around
    it (`box_step_ms` over the calibration's); 0.0 where either was not probed."""
    probed = step.get("box_step_ms", 0.0)
    return probed / calibration_step_ms if probed > 0 and calibration_step_ms > 0 else 0.0


def replay_steps(steps: list[dict], scenario: Scenario, config: CheckConfig, slo: Slo, sim: SimOptions,
                 calibration_step_ms: float = 0.0, workers: int = 1) -> None:  # fmt: skip
    """The planner on each served draw's own arrivals (`plan_replay.replay_verdict`), written into the draw as
    `replay`; with `calibration_step_ms`, again with every LLM and detok step scaled to the draw's own speed
    (`draw_speed_scale`: this VM's cores change speed by minutes; the host's CPU is left at the calibration's)
    as `replay_at_draw_speed`. Run with the cluster stopped: the simulation is CPU work (~5-10 s a seed a draw),
    over `workers` processes."""
    kept = [step for step in steps if not step.get("redrawn") and "requests" in step]
    jobs = [(scenario, shape_of(config), step["requests"], slo, sim, draw_speed_scale(step, calibration_step_ms))
            for step in kept]  # fmt: skip
    for step, (replayed, at_speed) in zip(kept, on_workers(_replay_draw, jobs, workers), strict=True):
        step[REPLAY] = replayed
        if at_speed is not None:
            step[AT_DRAW_SPEED] = at_speed
        print(f"{config.name} at {step['summary']['rate_rps']} req/s, draw {step['draw']}: served "
              f"{'met' if step['met'] else 'missed'}; on its arrivals the planner {_call(replayed)}"
              + (f", at the draw's speed (steps x{at_speed['scale']:.2f}) {_call(at_speed)}" if at_speed else ""),
              flush=True)  # fmt: skip


def _replay_draw(job: tuple) -> tuple[dict, dict | None]:
    """One draw's replays: at the calibration's speed, and at the draw's (`scale` > 0; else None)."""
    from loadtest.plan_replay import replay_verdict

    scenario, shape, requests, slo, sim, scale = job
    replayed = replay_verdict(scenario, shape, requests, slo, sim)
    if scale <= 0:
        return replayed, None
    return replayed, {**replay_verdict(scenario, shape, requests, slo, _scaled(sim, scale)), "scale": round(scale, 3)}


def on_workers(function, jobs: list, workers: int) -> list:
    """`function` over `jobs` in order, in `workers` processes (1: here). For the simulation's CPU work with no
    cluster up: one process a core."""
    if workers <= 1 or len(jobs) <= 1:
        return [function(job) for job in jobs]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
        return list(pool.map(function, jobs))


def _call(replayed: dict) -> str:
    return f"{'meets' if replayed['met'] else 'misses'} (p90 TTFA {', '.join(map(str, replayed['p90_ttfa_s']))} s)"


def replayed_capacity(steps: list[dict], key: str = REPLAY) -> tuple[float, bool]:
    """The capacity the planner calls on the check's own draws (replayed as `key`): the highest swept rate whose
    replayed draws mostly meet, with every lower rate's meeting too; and whether every swept rate's did (the served
    sweep stopped below what the planner calls, so the capacity is a floor). Draws not replayed are left out."""
    return capacity_by_majority(verdicts_by_rate(steps, key))


def replay_agreement(steps: list[dict], key: str = REPLAY) -> float | None:
    """The share of replayed draws the planner called as they were served (met / missed); None: none replayed."""
    calls = [step[key]["met"] == step["met"] for step in steps if key in step]
    return sum(calls) / len(calls) if calls else None


def served_crossings(
    steps: list[dict], scenario: Scenario, config: CheckConfig, slo: Slo, sim: SimOptions, duration_s: float,
    grid: tuple[float, ...], planner_by_rate: dict[float, list[dict]], draws: tuple[int, int],
    calibration_step_ms: float, workers: int, written_to: Path,
) -> Crossings:  # fmt: skip
    """Once the served draws are in and replayed: every side's crossing, the planner's draws again at the served
    rates with each rate's steps at its draws' speed (`rate_speed_scales`), both sets of planner draws written to
    `written_to`. `draws`: (served, planner) draws per rate; `grid`: the rates the planner drew first."""
    scales = rate_speed_scales(steps, calibration_step_ms)
    cap = max_requests_for(grid, duration_s)
    at_speed = planner_draws_by_rate(scenario, config, slo, sim, tuple(sorted(scales)), duration_s, draws[1], workers,
                                     scales, cap)  # fmt: skip
    written_to.parent.mkdir(parents=True, exist_ok=True)
    written = {"calibration_speed": {str(rate): d for rate, d in planner_by_rate.items()},
               "draws_speed": {str(rate): d for rate, d in at_speed.items()}, "scales": scales}  # fmt: skip
    written_to.write_text(json.dumps(written, indent=1))
    return Crossings(half_crossing(verdicts_by_rate(steps)), half_crossing(met_by_rate(planner_by_rate)),
                     half_crossing(verdicts_by_rate(steps, REPLAY)),
                     half_crossing(verdicts_by_rate(steps, AT_DRAW_SPEED)), draws[0], draws[1],
                     half_crossing(met_by_rate(at_speed)))  # fmt: skip


PLANNER_FIRST_SEED = 1000  # the planner's sweep-shaped draws: seeds apart from the served draws' (0, 1, ...)


def planner_draws_by_rate(
    scenario: Scenario, config: CheckConfig, slo: Slo, sim: SimOptions, rates: tuple[float, ...], duration_s: float,
    planner_draws: int, workers: int = 1, scales: dict[float, float] | None = None, cap: int = 0,
) -> dict[float, list[dict]]:  # fmt: skip
    """The planner's sweep-shaped draws at each rate (`plan_replay.planner_sweep_draws`, seeds from
    PLANNER_FIRST_SEED, each draw's requests capped at `cap`, else the sweep's for `rates`), over `workers`
    processes: run with no cluster up, the simulation is CPU work. `scales`: each rate's steps x its factor (the
    speed its served draws ran at, `rate_speed_scales`)."""
    from loadtest.workload import load_prompts

    seeds = list(range(PLANNER_FIRST_SEED, PLANNER_FIRST_SEED + planner_draws))
    cap = cap or max_requests_for(rates, duration_s)
    scales = scales or {}
    prompts, shape = load_prompts(), shape_of(config)
    jobs = [(scenario, shape, rate, slo, duration_s, seeds, prompts, _scaled(sim, scales.get(rate)), cap)
            for rate in rates]  # fmt: skip
    by_rate = dict(zip(rates, on_workers(_planner_rate, jobs, workers), strict=True))
    for rate, draws in by_rate.items():
        speed = f" at steps x{scales[rate]:.2f}" if scales.get(rate) else ""
        print(f"{config.name} at {rate} req/s{speed}: the planner meets {sum(d['met'] for d in draws)} of "
              f"{planner_draws} sweep-shaped draws", flush=True)  # fmt: skip
    return by_rate


def _scaled(sim: SimOptions, scale: float | None) -> SimOptions:
    """`sim` with every LLM and detok step x `scale` (unchanged for None or 0)."""
    return replace(sim, step_scale=scale, detok_scale=scale) if scale else sim


def rate_speed_scales(steps: list[dict], calibration_step_ms: float) -> dict[float, float]:
    """Each swept rate's steps x the speed its kept draws ran at (their mean `draw_speed_scale`); rates with no
    probed draw left out."""
    by_rate: dict[float, list[float]] = {}
    for step in steps:
        scale = draw_speed_scale(step, calibration_step_ms)
        if scale > 0 and not step.get("redrawn"):
            by_rate.setdefault(step["summary"]["rate_rps"], []).append(scale)
    return {rate: sum(values) / len(values) for rate, values in by_rate.items()}


def _planner_rate(job: tuple) -> list[dict]:
    from loadtest.plan_replay import planner_sweep_draws

    scenario, shape, rate, slo, duration_s, seeds, prompts, sim, cap = job
    return planner_sweep_draws(scenario, shape, rate, slo, duration_s, seeds, prompts, sim, max_requests=cap)


def met_by_rate(draws_by_rate: dict[float, list[dict]]) -> dict[float, list[bool]]:
    return {rate: [draw["met"] for draw in draws] for rate, draws in draws_by_rate.items()}


SERVED_AROUND = (0.7, 1.35)  # `rates_around`: the served rates, x where half the planner's draws meet


def rates_around(rates: tuple[float, ...], crossing: Crossing | None, span: tuple[float, float] = SERVED_AROUND,
                 least: int = 4) -> tuple[float, ...]:  # fmt: skip
    """The grid's rates within `span` x `crossing`, with at least one on each side of it (the nearest) and at least
    `least` in all (the nearest to it added); at a floor the highest `least`, at a ceiling the lowest."""
    ordered = sorted(rates)
    if crossing is None or crossing.bound == ">=":
        return tuple(ordered[-least:])
    if crossing.bound == "<":
        return tuple(ordered[:least])
    at = crossing.rps
    kept = {r for r in ordered if span[0] * at <= r <= span[1] * at}
    below, above = [r for r in ordered if r < at], [r for r in ordered if r >= at]
    kept |= set(below[-1:]) | set(above[:1])
    for rate in sorted(ordered, key=lambda r: abs(r - at)):
        if len(kept) >= least:
            break
        kept.add(rate)
    return tuple(sorted(kept))

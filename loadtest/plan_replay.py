"""The planner on a served draw's own arrivals, stream by stream (issue 40's check of the model).

`plan_check` compares a capacity the planner finds over its own Poisson draws with one the cluster meets over
the load test's. Near a configuration's capacity one draw of ~80 streams moves the p90 TTFA by 3x, so a miss
there may be the model or the draw. This takes the streams a served rate really sent (`loadtest.loop_stalls`'
JSON: each stream's send time, text length and audio) and simulates exactly those arrivals, each stream's
frames and prompt from what it sent, with the calibration: the p50 / p90 TTFA against the served ones, and
how the simulated TTFA of each stream follows the served one (their correlation over the streams).
Run: `python -m loadtest.plan_replay --calibration C.json --loop-stalls bench_out/loop_stalls_x/loop_stalls.json
--config cpu-1x1-cap4 [--seeds 0 1 2 3 4]`. A `plan_check` sweep's draws again (its `<config>.json`, which keeps
every draw's streams; no Ray): `--check-json bench_out/plan_check_x/cpu-1x1/cpu-1x1.json` in place of
`--loop-stalls`, with the check's calibration: each draw's verdict at the calibration's speed and at its own.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from cluster.planner.calibration import load_calibration
from cluster.planner.predict import Scenario, finish, first_heard_s, heard_s, percentile, run_llm_on
from cluster.planner.search import Slo, decide_by_draws, seeded
from cluster.planner.simulate import ClusterShape, Prediction, SimOptions
from cluster.planner.workload import Streams
from loadtest.plan_configs import CONFIGS, ORPHEUS_TINY, shape_of, sweep_workload


def served_streams(streams: list[dict], scenario: Scenario) -> tuple[Streams, np.ndarray]:
    """The streams of one served rate (`loop_stalls` rows' "streams") in send order, as the planner's `Streams`
    (frames from the audio each got, prompt tokens from its text as the workload counts them; every one
    measured), and each one's served TTFA (inf: no audio)."""
    ordered = sorted(streams, key=lambda s: s["scheduled_at_s"])
    start_s = ordered[0]["scheduled_at_s"] if ordered else 0.0
    workload, rates = scenario.workload, scenario.rates
    prompt = workload.prompt_tokens_for(np.asarray([s["text_chars"] for s in ordered], np.float64))
    frames = np.asarray([round(sum(s["durations_s"]) / rates.frame_s) for s in ordered], np.int64)
    arrival = np.asarray([s["scheduled_at_s"] - start_s for s in ordered])
    ttfa = np.asarray([s["arrivals_s"][0] if s["arrivals_s"] else np.inf for s in ordered])
    return Streams(arrival, np.maximum(frames, 1), prompt, np.ones(len(ordered), bool)), ttfa


def replay(scenario: Scenario, shape: ClusterShape, streams: Streams, served_ttfa: np.ndarray,
           seeds: list[int]) -> list[dict]:  # fmt: skip
    """Per seed of the steps' spread: the simulated p50 / p90 TTFA and queue wait of `streams`, and the
    correlation of each stream's simulated TTFA with its served one."""
    rows = []
    for seed in seeds:
        options = SimOptions(seed=seed)
        run = run_llm_on(scenario, streams, shape, options)
        heard, _ = heard_s(scenario, run, shape.detok_replicas, options)
        ttfa = first_heard_s(streams.count, run.llm, heard) - streams.arrival_s
        both = np.isfinite(ttfa) & np.isfinite(served_ttfa)
        wait = run.llm.admitted_s - streams.arrival_s
        rows.append({
            "seed": seed, "p50_ttfa_s": percentile(ttfa, 50), "p90_ttfa_s": percentile(ttfa, 90),
            "queue_wait_p90_s": float(np.nanpercentile(wait, 90)) if np.isfinite(wait).any() else float("inf"),
            "ttfa_correlation": float(np.corrcoef(ttfa[both], served_ttfa[both])[0, 1]) if both.sum() > 2 else 0.0,
        })  # fmt: skip
    return rows


def replay_verdict(scenario: Scenario, shape: ClusterShape, served: list[dict], slo: Slo,
                   sim: SimOptions) -> dict:  # fmt: skip
    """The planner's call on one served draw (its streams as the sweep records them), on the draw's own
    arrivals: whether it meets `slo` in most of `sim.seeds` runs of the steps' spread (seeds `sim.seed`, +1, ...,
    stopping once the majority is decided, as `search.meets_slo` decides a load), and each run's p90 TTFA and
    viable share. `plan_check` asks it of every draw it served, so a draw's luck counts on both sides."""
    streams, _ = served_streams(served, scenario)

    def predict_draw(index: int) -> Prediction:
        options = seeded(sim, index)
        return finish(scenario, run_llm_on(scenario, streams, shape, options), shape.detok_replicas, options)

    met, predictions = decide_by_draws(sim.seeds, slo, predict_draw)
    return {"met": met, "p90_ttfa_s": [round(p.p90_ttfa_s, 4) for p in predictions],
            "viable_pct": [round(p.viable_pct, 2) for p in predictions]}  # fmt: skip


def sweep_shaped_streams(scenario: Scenario, rate_rps: float, duration_s: float, seed: int, prompts: list[str],
                         min_requests: int = 8, max_requests: int = 1_000_000) -> Streams:  # fmt: skip
    """The streams a sweep draw of `seed` at `rate_rps` sends (`loadtest.sweep.run_rate`: its arrivals and
    texts, drawn in the same order from the same seed), each one's frames and prompt as the planner's workload
    counts them: cold start, every arrival measured, no tail, as the served draw is measured."""
    import random

    from loadtest.workload import arrival_offsets_s

    rng = random.Random(f"{seed}-{rate_rps}")
    offsets = arrival_offsets_s(rate_rps, duration_s, min_requests, max_requests, rng)
    chars = np.asarray([len(prompts[rng.randrange(len(prompts))]) for _ in offsets], np.float64)
    frames = scenario.workload.frames_for(chars, scenario.rates)
    prompt = scenario.workload.prompt_tokens_for(chars)
    return Streams(np.asarray(offsets), np.maximum(frames, 1), prompt, np.ones(len(offsets), bool))


def planner_sweep_draws(scenario: Scenario, shape: ClusterShape, rate_rps: float, slo: Slo, duration_s: float,
                        seeds: list[int], prompts: list[str], sim: SimOptions = SimOptions(),
                        max_requests: int = 1_000_000) -> list[dict]:  # fmt: skip
    """The planner's share of met draws at a swept rate, on draws shaped as the sweep's (`sweep_shaped_streams`
    of each seed; seeds apart from the served draws'): one run of the steps' spread per draw, as each served draw
    is one arrival sample under one spell of the box. Each: {seed, met, p90_ttfa_s, viable_pct}."""
    out = []
    for seed in seeds:
        streams = sweep_shaped_streams(scenario, rate_rps, duration_s, seed, prompts, max_requests=max_requests)
        options = replace(sim, seed=seed)
        prediction = finish(scenario, run_llm_on(scenario, streams, shape, options), shape.detok_replicas, options)
        out.append(
            {
                "seed": seed,
                "met": prediction.meets(slo.ttfa_p90_s, slo.min_viable_pct),
                "p90_ttfa_s": round(prediction.p90_ttfa_s, 4),
                "viable_pct": round(prediction.viable_pct, 2),
            }
        )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, required=True, help="a JSON written by loadtest.plan_calibrate")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--loop-stalls", type=Path, help="loop_stalls.json of a served run")
    source.add_argument("--check-json", type=Path, help="a plan_check sweep's <config>.json: its draws replayed")
    parser.add_argument("--config", choices=[c.name for c in CONFIGS], required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--ttfa-p90-s", type=float, default=1.0, help="the SLO the check swept (--check-json)")
    parser.add_argument("--planner-draws", type=int, default=0,
                        help="--check-json: the planner's draws per swept rate, for the crossings")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1, help="processes for the simulation (no cluster up)")
    args = parser.parse_args(argv)
    scenario = Scenario(load_calibration(args.calibration), ORPHEUS_TINY, sweep_workload())
    config = next(c for c in CONFIGS if c.name == args.config)
    if args.check_json is not None:
        return replay_check(args.check_json, scenario, config, Slo(args.ttfa_p90_s), len(args.seeds),
                            _calibration_step_ms(args.calibration), args.planner_draws, args.workers)  # fmt: skip
    shape = shape_of(config)
    out = []
    for row in json.loads(args.loop_stalls.read_text()):
        streams, served = served_streams(row["streams"], scenario)
        print(f"{args.config} at {row['rate_rps']} req/s, {streams.count} streams served: p50 TTFA "
              f"{percentile(served, 50):.2f} s, p90 {percentile(served, 90):.2f} s")  # fmt: skip
        for result in replay(scenario, shape, streams, served, args.seeds):
            print(f"  simulated on the same arrivals, seed {result['seed']}: p50 {result['p50_ttfa_s']:.2f} s, "
                  f"p90 {result['p90_ttfa_s']:.2f} s, queue p90 {result['queue_wait_p90_s']:.2f} s; each stream's "
                  f"TTFA against the served one: correlation {result['ttfa_correlation']:.2f}")  # fmt: skip
            out.append({"rate_rps": row["rate_rps"], "served_p90_ttfa_s": percentile(served, 90), **result})
    return out


def replay_check(path: Path, scenario: Scenario, config, slo: Slo, seeds: int, calibration_step_ms: float,
                 planner_draws: int = 0, workers: int = 1) -> list[dict]:  # fmt: skip
    """A plan_check sweep's kept draws replayed again (`plan_draws.replay_steps`), at the calibration's speed and
    at each draw's: the capacity the planner calls over the swept rates, and the draws it calls as served. With
    `planner_draws`, `--fixed-draws`' crossings too: the planner's own sweep-shaped draws at the swept rates, at the
    calibration's speed and at each rate's draws' (written beside `path` as planner_draws_again.json); the replays
    the check wrote are then kept, not run again."""
    from loadtest.plan_check import crossing_report
    from loadtest.plan_draws import (
        AT_DRAW_SPEED,
        REPLAY,
        planner_draws_by_rate,
        replay_agreement,
        replay_steps,
        replayed_capacity,
        served_crossings,
    )

    check = json.loads(path.read_text())
    steps, sim = check["steps"], SimOptions(seeds=seeds)
    # with planner draws the replays the check wrote stand (the simulation is deterministic): only draws without them
    pending = [step for step in steps if not planner_draws or REPLAY not in step or AT_DRAW_SPEED not in step]
    replay_steps(pending, scenario, config, slo, sim, calibration_step_ms, workers)
    if planner_draws > 0:
        cfg = check["config"]  # the sweep's: its rates, duration and cap on a draw's requests
        rates = tuple(sorted(cfg["rates_rps"]))
        first = planner_draws_by_rate(scenario, config, slo, sim, rates, cfg["duration_s"], planner_draws, workers,
                                      cap=cfg["max_requests"])  # fmt: skip
        crossings = served_crossings(steps, scenario, config, slo, sim, cfg["duration_s"], rates, first,
                                     (check["draws"], planner_draws), calibration_step_ms, workers,
                                     path.parent / "planner_draws_again.json")  # fmt: skip
        print("\n".join(crossing_report([_crossing_result(config.name, crossings)])))
    out = []
    for key in (REPLAY, AT_DRAW_SPEED):
        capacity, is_floor = replayed_capacity(steps, key)
        agreement = replay_agreement(steps, key)
        if agreement is None:
            continue
        print(f"{config.name}, {key}: the planner calls {'>= ' if is_floor else ''}{capacity:.3f} req/s over the "
              f"swept rates; {100 * agreement:.0f}% of the draws as served")  # fmt: skip
        out.append({"replay": key, "capacity_rps": capacity, "is_floor": is_floor, "agreement": agreement})
    return out


def _crossing_result(name: str, crossings):  # -> plan_check.CheckResult, for its crossing table alone
    from loadtest.plan_check import CheckResult

    return CheckResult(name, 0.0, 0.0, (), crossings=crossings)


def _calibration_step_ms(path: Path) -> float:
    """The LLM step the calibration probed (`box_speed.step_ms`; 0.0: not probed)."""
    return float(json.loads(path.read_text()).get("box_speed", {}).get("step_ms", 0.0))


if __name__ == "__main__":
    main()

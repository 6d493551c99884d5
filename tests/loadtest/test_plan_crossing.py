"""loadtest/plan_crossing.py and `plan_check --fixed-draws`: the capacity where half of a rate's draws meet the SLO
(the share fitted non-increasing in the rate, the crossing interpolated), the same estimator on both sides, and the
planner's own draws shaped as the sweep's (the sweep's arrivals and texts from the same seed). No cluster."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cluster.planner.calibration import CALIBRATION_DIR, load_calibration
from cluster.planner.predict import Scenario
from cluster.planner.search import Slo
from loadtest.plan_check import CheckResult, crossing_report
from loadtest.plan_configs import CONFIGS, ORPHEUS_TINY, shape_of, sweep_workload
from loadtest.plan_crossing import (
    Crossing,
    capacity_by_majority,
    half_crossing,
    non_increasing_fit,
    relative_error,
    verdicts_by_rate,
)
from loadtest.plan_draws import Crossings
from loadtest.plan_replay import planner_sweep_draws, sweep_shaped_streams

T, F = True, False


def test_the_fit_never_rises_pooling_adjacent_violators_by_their_draws():
    assert non_increasing_fit([1.0, 0.5, 0.75, 0.0], [4, 4, 4, 4]) == [1.0, 0.625, 0.625, 0.0]
    assert non_increasing_fit([0.25, 1.0], [3, 1]) == [0.4375, 0.4375]  # (3 x 0.25 + 1.0) / 4
    assert non_increasing_fit([1.0, 0.75, 0.0], [1, 1, 1]) == [1.0, 0.75, 0.0]  # already non-increasing


def test_the_capacity_is_where_the_fitted_share_crosses_one_half():
    by_rate = {1.0: [T, T, T, T], 1.2: [T, T, T, F], 1.4: [T, F, F, F], 1.6: [F, F, F, F]}
    assert half_crossing(by_rate) == Crossing(pytest.approx(1.3))  # 0.75 at 1.2, 0.25 at 1.4: halfway
    assert capacity_by_majority(by_rate) == (1.2, False)  # the old rule on the same draws


def test_one_unlucky_rate_does_not_stop_the_estimate_where_it_stops_the_majority_rule():
    """Identical arrivals served again flip their verdict about one time in four near capacity (run j): a rate
    below capacity may miss by luck. The majority rule stops there; the fit pools it with the next rate."""
    by_rate = {1.0: [T, T, T, T], 1.2: [T, F, F, F], 1.4: [T, T, T, F], 1.6: [F, F, F, F]}
    assert capacity_by_majority(by_rate) == (1.0, False)
    assert half_crossing(by_rate) == Crossing(pytest.approx(1.3))  # 1.2 and 1.4 pooled at one half: their middle


def test_a_crossing_outside_the_swept_rates_is_a_floor_or_a_ceiling():
    assert half_crossing({1.0: [T, T], 1.2: [T, F]}) == Crossing(1.2, ">=")
    assert half_crossing({1.0: [F, F], 1.2: [F, F]}) == Crossing(1.0, "<")
    assert half_crossing({}) is None and half_crossing({1.0: []}) is None
    assert Crossing(1.2, ">=").cell() == ">= 1.20" and Crossing(1.234).cell() == "1.23"
    assert relative_error(Crossing(1.3), Crossing(1.0)) == pytest.approx(0.3)
    assert relative_error(Crossing(1.3), Crossing(1.0, ">=")) is None and relative_error(None, Crossing(1.0)) is None


def test_the_draws_by_rate_leave_out_redrawn_ones_and_draws_without_the_call():
    steps = [{"summary": {"rate_rps": 1.0}, "met": True, "replay": {"met": False}},
             {"summary": {"rate_rps": 1.0}, "met": False, "redrawn": True, "replay": {"met": True}},
             {"summary": {"rate_rps": 1.2}, "met": False}]  # fmt: skip
    assert verdicts_by_rate(steps) == {1.0: [True], 1.2: [False]}
    assert verdicts_by_rate(steps, "replay") == {1.0: [False]}


def test_the_verdict_compares_the_two_crossings_and_says_when_one_is_outside():
    inside = CheckResult("cpu-1x1-cap4", 1.7, 1.0, (1.0, 1.4),
                         crossings=Crossings(Crossing(1.1), Crossing(1.3), Crossing(1.2), None, 6, 16))  # fmt: skip
    assert inside.crossings.error == pytest.approx(0.2 / 1.1) and inside.verdict == "yes"
    lines = crossing_report([inside])
    assert "| cpu-1x1-cap4 | 1.70 | 1.30 | 1.10 | 18% | yes | - | - | 1.20 | - | 6 / 16 |" in lines[3]
    at_speed = replace(inside, crossings=replace(inside.crossings, planner_at_speed=Crossing(1.0)))
    assert at_speed.crossings.error_at_speed == pytest.approx(0.1 / 1.1)
    assert "| yes | 1.00 | 9% | 1.20 |" in crossing_report([at_speed])[3]
    far = CheckResult("cpu-1x1", 3.0, 2.0, (2.0,), crossings=Crossings(Crossing(1.0), Crossing(1.5)))
    assert far.verdict == "no"
    floor = CheckResult("cpu-1x1", 3.0, 2.0, (2.0,), crossings=Crossings(Crossing(2.0, ">="), Crossing(1.5)))
    assert floor.verdict == "no verdict: a crossing outside the swept rates"
    assert crossing_report([CheckResult("cpu-1x1", 3.0, 2.0, (2.0,))]) == []
    assert far.majority_verdict == "no" and inside.majority_verdict == "no"  # 1.7 vs 1.0 by the majority rule
    from loadtest.plan_check import report

    assert "| 70% | no |" in report([inside])[2]  # the first table keeps the majority rule's verdict


def test_the_planners_draws_send_what_the_sweep_sends_from_the_same_seed(monkeypatch):
    """`loadtest.sweep.run_rate` with a recording stand-in for the gRPC call (no cluster): each arrival's send time
    and text are those of the sweep-shaped streams of the same seed and rate."""
    import loadtest.sweep as sweep
    from loadtest.metrics import RequestRecord
    from loadtest.workload import load_prompts

    sent: dict[int, str] = {}

    def record(stub, text, seed, cfg):
        sent[seed - cfg.seed * 100_000] = text  # the arrival's index, as run_rate seeds each request
        return RequestRecord(is_ok=True)

    monkeypatch.setattr(sweep, "run_one", record)
    cfg = sweep.SweepConfig(rates_rps=(40.0,), duration_s=0.3, seed=7)
    prompts = load_prompts()
    records = sweep.run_rate(None, 40.0, prompts, cfg)
    scenario = Scenario(load_calibration(CALIBRATION_DIR / "cpu-orpheus-tiny.json"), ORPHEUS_TINY, sweep_workload())
    streams = sweep_shaped_streams(scenario, 40.0, 0.3, 7, prompts, cfg.min_requests, cfg.max_requests)
    assert sorted(r.scheduled_at_s for r in records) == pytest.approx(streams.arrival_s.tolist())
    assert streams.count >= cfg.min_requests and streams.is_measured.all()
    chars = np.asarray([len(sent[i]) for i in range(len(sent))], np.float64)  # in send order
    assert streams.prompt_tokens.tolist() == scenario.workload.prompt_tokens_for(chars).tolist()


def test_the_planner_meets_a_light_sweep_shaped_load_and_misses_a_flood():
    scenario = Scenario(load_calibration(CALIBRATION_DIR / "cpu-orpheus-tiny.json"), ORPHEUS_TINY, sweep_workload())
    cap4 = shape_of(next(c for c in CONFIGS if c.name == "cpu-1x1-cap4"))
    prompts = ["Hello there, how are you today?"] * 4
    light = planner_sweep_draws(scenario, cap4, 0.2, Slo(1.0), 20.0, [1000, 1001], prompts)
    flood = planner_sweep_draws(scenario, cap4, 8.0, Slo(1.0), 20.0, [1000, 1001], prompts)
    assert [d["met"] for d in light] == [True, True] and [d["seed"] for d in light] == [1000, 1001]
    assert [d["met"] for d in flood] == [False, False]


def test_the_served_rates_are_the_grids_around_where_half_the_planners_draws_meet():
    from loadtest.plan_draws import rates_around

    grid = (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.4, 2.8)
    assert rates_around(grid, Crossing(1.7)) == (1.2, 1.4, 1.6, 1.8, 2.0)  # 0.7-1.35 x 1.7: 1.19-2.295
    assert rates_around(grid, Crossing(2.9, ">=")) == (1.8, 2.0, 2.4, 2.8)  # a floor: the highest four
    assert rates_around(grid, Crossing(1.0, "<")) == (1.0, 1.2, 1.4, 1.6)  # a ceiling: the lowest four
    assert rates_around((1.0, 2.0, 4.0), Crossing(2.5)) == (1.0, 2.0, 4.0)  # a rate on each side, three in all
    assert rates_around((1.0, 1.1, 3.0, 3.1, 3.2), Crossing(1.05)) == (1.0, 1.1, 3.0, 3.1)  # the nearest added


def test_the_simulations_cpu_work_runs_on_processes_in_order():
    from loadtest.plan_draws import on_workers

    assert on_workers(abs, [-1, -2, 3, -4], 2) == [1, 2, 3, 4] == on_workers(abs, [-1, -2, 3, -4], 1)

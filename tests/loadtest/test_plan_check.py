"""The planner-vs-cluster check's pure parts (calibration rewrite, workload, rates, verdict); no Ray started."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from cluster.planner.calibration import parse_calibration
from cluster.planner.predict import Scenario, predict
from cluster.planner.search import Slo
from cluster.planner.simulate import ClusterShape, SimOptions
from loadtest.host_cost import chunk_windows
from loadtest.host_fit import (
    HostCost,
    SaturatedLoad,
    SetCost,
    background_split,
    calibration_host,
    saturated_host_ms_per_chunk,
    split_host,
)
from loadtest.plan_calibrate import (
    CPU_CALIBRATION,
    calibration_with_host,
    calibration_with_steps,
    serving_loop_line,
    serving_loop_table,
    with_assumptions,
)
from loadtest.plan_check import CheckResult, predicted_rps, report, swept_rates
from loadtest.plan_configs import CONFIGS, ORPHEUS_TINY, sweep_workload
from loadtest.plan_served import BoxCpu
from loadtest.workload import MAX_FRAMES, MIN_FRAMES, ORPHEUS_FRAME_RATE_HZ, load_prompts, max_tokens_for


def test_the_measured_steps_replace_the_table_and_say_so():
    base = json.loads(CPU_CALIBRATION.read_text())
    data = calibration_with_steps(base, {4: 7.0, 1: 5.0}, "step_bench here")
    calib = parse_calibration(data)
    assert calib.llm_step.rows == (1, 4) and calib.llm_step.step_ms(np.asarray([4]), np.asarray([50.0]))[0] == 7.0
    assert data["sources"]["llm.step_ms"] == "step_bench here"
    assert base["llm"]["step_ms"]["rows"] != [1, 4]  # the bundled file is left as it was


def test_the_workload_cuts_the_sweeps_prompts_into_the_sweeps_frames():
    workload = sweep_workload()
    chars = np.asarray(workload.text_chars, np.float64)
    frames = workload.frames_for(chars, ORPHEUS_TINY)
    expected = [max_tokens_for(text) // 7 for text in load_prompts()]
    assert frames.min() >= MIN_FRAMES and frames.max() <= MAX_FRAMES
    assert np.abs(frames - np.asarray(expected)).max() <= 1  # the same ~0.78 frames per character


def test_rates_bracket_the_prediction_and_the_verdict_is_25_pct():
    rates = swept_rates(1.0)
    assert min(rates) < 1.0 < max(rates) and 1.0 in rates
    assert CheckResult("x", 1.2, 1.0, rates).within_25_pct
    assert not CheckResult("x", 1.3, 1.0, rates).within_25_pct
    assert not CheckResult("x", 1.0, 0.0, rates).within_25_pct


def test_the_prediction_for_the_default_cpu_config_is_a_positive_rate():
    calib = parse_calibration(json.loads(CPU_CALIBRATION.read_text()))
    scenario = Scenario(calib, ORPHEUS_TINY, sweep_workload())
    capped = next(c for c in CONFIGS if c.name == "cpu-1x1-cap4")
    assert 0 < predicted_rps(scenario, capped, Slo(1.0), SimOptions(min_measured=20)) < 100


def _set(name: str, streams: int, chunks: int, host_cpu_s: float) -> SetCost:
    return SetCost(name, streams, chunks, tokens=streams * 280, wall_s=10.0, llm_cpu_s=streams * 0.6,
                   detok_cpu_s=chunks * 0.02, host_cpu_s=host_cpu_s, ttfa_p50_s=0.2, cpu_s_by_role={},
                   windows=(14,) * chunks)  # fmt: skip


def test_the_host_cost_splits_into_a_start_and_a_chunk():
    # 10 ms a stream + 2 ms a chunk: 4 chunks a stream -> 18 ms, 10 chunks a stream -> 30 ms
    short, long = _set("short", 10, 40, 0.18), _set("long", 10, 100, 0.30)
    assert split_host(short, long) == pytest.approx((10.0, 2.0))
    same = _set("same", 10, 42, 0.20)
    assert split_host(short, same) == pytest.approx((0.0, 1e3 * 0.38 / 82))  # no spread: all of it a chunk's


def test_chunk_windows_add_the_context_each_chunk_decodes_with():
    frame_s = 1 / ORPHEUS_FRAME_RATE_HZ
    assert chunk_windows([4 * frame_s, 8 * frame_s, 8 * frame_s, 2 * frame_s]) == [
        4 + 3,
        8 + 6,
        8 + 3 + 2,
        2 + 3,
    ]  # the third: 2 frames after it
    assert chunk_windows([2 * frame_s]) == [2]


def test_the_served_c1_costs_enter_the_calibration_with_their_sources():
    base = calibration_with_steps(json.loads(CPU_CALIBRATION.read_text()), {1: 2.0, 4: 3.0}, "here")
    short, long = _set("short", 10, 40, 0.18), _set("long", 10, 100, 0.30)
    cost = HostCost(background_cores=0.1, host_ms_per_stream=10.0, host_ms_per_chunk=2.0, llm_ms_per_token=2.5,
                    detok_ms_per_chunk=12.0, ttfa_p50_s=0.2, sets=(short, long), loaded_step_ms_by_rows={},
                    detok_windows=(14,) * 140)  # fmt: skip
    data = calibration_with_host(base, cost, 2, "host_cost here")
    calib = parse_calibration(data)
    assert calib.pipeline_step_factor == pytest.approx(1.25)  # 2.5 ms a token in the replica / 2.0 alone
    assert float(calib.detok.batch_ms(14.0)) == pytest.approx(12.0, abs=0.01)  # the table scaled to the replica's chunk
    assert (calib.host.cores, calib.host.cpu_ms_per_stream, calib.host.cpu_ms_per_chunk) == (2, 10.0, 2.0)
    assert {"llm.pipeline_step_factor", "detok", "host"} <= set(data["sources"])
    shape, options = ClusterShape(1, 1, 12, 4), SimOptions(min_measured=20)
    shared, alone = (predict(Scenario(c, ORPHEUS_TINY, sweep_workload()), 6.0, shape, options)
                     for c in (calib, parse_calibration(base)))  # fmt: skip
    assert alone.p50_ttfa_s < shared.p50_ttfa_s < float("inf")  # the shared cores and the served loop cost time


def test_the_serving_loops_step_by_rows_becomes_the_table_the_planner_steps_by():
    steps = {1: 2.1, 2: 2.8, 3: 3.6, 4: 3.5, 6: 5.7, 8: 7.1}  # a fixed cost, then ~0.7 ms a row, noisy
    base_ms, per_row_ms = serving_loop_line(steps)
    assert serving_loop_line({1: 2.0, 4: 3.0}) is None  # too few sizes to fit
    table = serving_loop_table(steps, top=12)
    assert list(table) == [1, 2, 3, 4, 6, 8, 12]
    assert table[4] == 3.6  # never cheaper than the size below it
    assert table[12] == pytest.approx(7.1 + 4 * per_row_ms, abs=1e-3)  # past the largest, along the line
    base = calibration_with_steps(json.loads(CPU_CALIBRATION.read_text()), {1: 2.0, 4: 3.0}, "here")
    cost = HostCost(background_cores=0.1, host_ms_per_stream=10.0, host_ms_per_chunk=2.0, llm_ms_per_token=2.5,
                    detok_ms_per_chunk=12.0, ttfa_p50_s=0.2, sets=(), loaded_step_ms_by_rows=steps,
                    detok_windows=(14,) * 10,
                    loaded_step_spread={"spell_s": 0.5, "spells": [0.9, 1.1], "steps": [0.8, 1.2]})  # fmt: skip
    calib = parse_calibration(calibration_with_host(base, cost, 2, "host_cost here"))
    at = calib.llm_step.step_ms(np.asarray([1, 2, 5, 12]), np.full(4, 200.0))
    assert at.tolist() == pytest.approx([2.1, 2.8, (3.6 + 5.7) / 2, table[12]], abs=1e-3)  # not a line: 1 row is dear
    assert calib.pipeline_step_factor == 1.0 and "mean cycle" in calib.sources["llm.step_ms"]
    assert calib.llm_step_spread.steps == (0.8, 1.2) and "spells" in calib.sources["llm.step_spread"]
    no_spread = parse_calibration(calibration_with_host(base, replace(cost, loaded_step_spread=None), 2, "here"))
    assert no_spread.llm_step_spread is None and "llm.step_spread" not in no_spread.sources


def test_the_saturated_level_prices_a_chunk_and_replaces_the_c1_difference():
    """At load the host's CPU over many chunks, less the c=1 start cost a stream, is a chunk's cost; the
    calibration's `host` section takes it over the c=1 sets' difference (two small sums)."""
    saturated = SaturatedLoad(clients=12, wall_s=10.0, streams=20, chunks=300, host_cpu_s=1.1, llm_cpu_s=9.0,
                              detok_cpu_s=6.0)  # fmt: skip
    assert saturated.chunks_per_s == 30.0
    assert saturated_host_ms_per_chunk(saturated, host_ms_per_stream=10.0) == pytest.approx((1100 - 200) / 300)
    assert saturated_host_ms_per_chunk(saturated, host_ms_per_stream=100.0) == 0.0  # never below 0
    cost = HostCost(background_cores=0.1, host_ms_per_stream=10.0, host_ms_per_chunk=9.0, llm_ms_per_token=2.5,
                    detok_ms_per_chunk=12.0, ttfa_p50_s=0.2, sets=(), loaded_step_ms_by_rows={},
                    detok_windows=(14,), saturated=saturated)  # fmt: skip
    assert calibration_host(cost, 2)["cpu_ms_per_chunk"] == pytest.approx(3.0)
    without = HostCost(**{**cost.__dict__, "saturated": None})
    assert calibration_host(without, 2)["cpu_ms_per_chunk"] == 9.0


def test_the_written_calibration_states_its_assumptions_and_the_c1_gap():
    data = calibration_with_steps(json.loads(CPU_CALIBRATION.read_text()), {1: 2.0, 4: 3.0}, "here")
    cost = HostCost(background_cores=0.1, host_ms_per_stream=10.0, host_ms_per_chunk=2.0, llm_ms_per_token=2.5,
                    detok_ms_per_chunk=12.0, ttfa_p50_s=0.2, sets=(), loaded_step_ms_by_rows={},
                    detok_windows=(14,))  # fmt: skip
    out = with_assumptions(data, cost, zero_load_ttfa_s=0.15)
    assert len(out["assumptions"]) >= 4 and "assumptions" not in data
    assert out["c1_check"]["unmodelled_start_latency_s"] == pytest.approx(0.05)
    parse_calibration(out)  # the planner reads it as it is
    assert "c1_check" not in with_assumptions(data, None, 0.15)


def test_the_other_tenants_cores_are_the_boxs_busy_cpu_less_ours():
    before = BoxCpu(box_busy_s=100.0, ours_s=10.0, at_s=0.0)
    after = BoxCpu(box_busy_s=130.0, ours_s=22.0, at_s=10.0)  # 30 CPU s busy in 10 s, 12 of them ours
    assert after.others_cores_since(before) == pytest.approx(1.8)
    assert BoxCpu(105.0, 20.0, 10.0).others_cores_since(before) == 0.0  # ours counted past the box's: never < 0
    assert before.others_cores_since(before) == 0.0
    stolen = BoxCpu(box_busy_s=130.0, ours_s=22.0, at_s=10.0, steal_s=3.0)
    assert stolen.steal_cores_since(before) == pytest.approx(0.3)
    table = report([CheckResult("cpu-1x1", 2.0, 1.0, (1.0, 2.0), others_cores=1.8, steal_cores=0.3)])
    assert table[-1].endswith("| 1.80 | 0.30 | - | - |")  # the box's speed not probed
    slower = CheckResult("cpu-1x1", 2.0, 1.0, (1.0, 2.0), box_speed_ratio=0.64)
    assert report([slower])[-1].endswith("| 0.64 | - |")
    assert slower.is_off_speed and slower.verdict == "no verdict: box off speed"  # 100% off, on a slower box
    steady = CheckResult("cpu-1x1", 2.0, 1.0, (1.0, 2.0), box_speed_ratio=0.95)
    assert not steady.is_off_speed and steady.verdict == "no"
    assert CheckResult("cpu-1x1", 1.1, 1.0, (1.0,), box_speed_ratio=1.08).verdict == "yes"
    assert CheckResult("cpu-1x1", 1.1, 1.0, (1.0,)).verdict == "yes"  # not probed: judged as before
    # the Python unit steady, the LLM step 20% slower than at calibration: no verdict either
    step_slower = CheckResult("cpu-1x1", 1.1, 1.0, (1.0,), box_speed_ratio=1.0, step_speed_ratio=0.8)
    assert step_slower.is_off_speed and report([step_slower])[-1].endswith("| 1.00 | 0.80 |")


def test_the_box_speed_is_read_at_the_draws_that_decided_the_capacity():
    from loadtest.plan_served import deciding_draws

    def step(rate: float, units: float) -> dict:
        return {"summary": {"rate_rps": rate}, "box_units_per_s": units, "box_step_ms": 1000 / units}

    steps = [step(1.0, 240), step(1.2, 230), step(1.2, 225), step(1.4, 190), step(1.4, 180)]
    assert [s["box_units_per_s"] for s in deciding_draws(steps, 1.2)] == [230, 225, 190, 180]
    assert [s["box_units_per_s"] for s in deciding_draws(steps[:3], 1.2)] == [230, 225]  # every rate met
    assert [s["box_units_per_s"] for s in deciding_draws(steps[:1], 0.0)] == [240]  # the lowest rate missed


def test_a_draw_on_an_off_speed_box_runs_again_with_its_seed():
    from loadtest.plan_served import MAX_REDRAWS, deciding_draws, on_speed, rate_verdict

    assert on_speed({"box_step_ms": 3.1}, 3.0) and not on_speed({"box_step_ms": 3.6}, 3.0)
    assert on_speed({"box_step_ms": 3.6}, 0.0) and on_speed({}, 3.0)  # unprobed: kept as before
    runs: list[int] = []
    probes = iter([3.0, 4.0, 3.1, 2.9])  # the second draw's box ran slow: it runs again

    def run_draw(index: int) -> tuple[bool, dict]:
        runs.append(index)
        return True, {"summary": {"rate_rps": 1.0}, "draw": index, "box_step_ms": next(probes)}

    met, steps = rate_verdict(run_draw, 3, lambda step: on_speed(step, 3.0))
    assert met and runs == [0, 1, 1] and [s.get("redrawn", False) for s in steps] == [False, True, False]
    assert [s["box_step_ms"] for s in deciding_draws(steps, 1.0)] == [3.0, 3.1]  # the redrawn one left out
    slow = lambda index: (False, {"summary": {"rate_rps": 1.0}, "box_step_ms": 5.0})  # noqa: E731
    met, steps = rate_verdict(slow, 3, lambda step: on_speed(step, 3.0))
    assert not met and len(steps) == MAX_REDRAWS + 2  # redrawn up to the cap, then counted as they are


def spin_cpu_s() -> float:
    """Fixed work in a spawned child; its own CPU seconds (whatever the box's load stretches its wall time to)."""
    import time

    from loadtest.box_speed import _unit

    for _ in range(20):
        _unit()
    return time.process_time()


def test_the_clients_cpu_counts_the_probes_it_spawned():
    import multiprocessing

    from loadtest.host_cost import client_cpu_s

    before = client_cpu_s()
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # as the box-speed probes run, ended and reaped
        child_s = pool.apply(spin_cpu_s)
    assert client_cpu_s() - before >= 0.9 * child_s > 0  # not "another tenant's" cores in BoxCpu


def test_the_box_speed_probe_counts_work_units_on_every_core():
    from loadtest.box_speed import box_step_ms, box_units_per_s, speed_ratio, units_per_s

    assert box_step_ms() > 0  # the LLM engine's step at 4 rows, in a fresh process
    assert units_per_s(0.05) > 0
    assert box_units_per_s(0.05, cores=2) > 0  # spawned processes, summed
    assert speed_ratio(64.0, 100.0) == pytest.approx(0.64)
    assert speed_ratio(64.0, 0.0) == 0.0  # a calibration without a probe: unknown, not infinite


def test_the_hosts_cpu_at_load_splits_into_a_streams_and_a_chunks_cost_over_the_levels():
    from loadtest.host_fit import split_host_at_load

    def level(streams: int, chunks: int, per_stream_ms: float, per_chunk_ms: float) -> SaturatedLoad:
        host_s = (streams * per_stream_ms + chunks * per_chunk_ms) / 1e3
        return SaturatedLoad(clients=2, wall_s=10.0, streams=streams, chunks=chunks, host_cpu_s=host_s,
                             llm_cpu_s=1.0, detok_cpu_s=1.0)  # fmt: skip

    levels = (level(10, 100, 20.0, 3.0), level(20, 150, 20.0, 3.0), level(40, 400, 20.0, 3.0))
    per_stream, per_chunk = split_host_at_load(levels)
    assert (per_stream, per_chunk) == (pytest.approx(20.0), pytest.approx(3.0))
    only_chunks = (level(10, 100, 0.0, 4.0), level(20, 150, 0.0, 4.0), level(40, 400, 0.0, 4.0))
    assert split_host_at_load(only_chunks) == (pytest.approx(0.0, abs=1e-6), pytest.approx(4.0))
    assert split_host_at_load(levels[:1]) is None
    negative = (level(10, 100, -1.0, 4.0), level(20, 150, -1.0, 4.0), level(40, 400, -1.0, 4.0))
    per_stream, per_chunk = split_host_at_load(negative)  # a negative start cost is no cost: chunks alone
    assert per_stream == 0.0 and 3.0 < per_chunk < 4.0
    cost = HostCost(background_cores=0.1, host_ms_per_stream=0.0, host_ms_per_chunk=9.0, llm_ms_per_token=2.5,
                    detok_ms_per_chunk=12.0, ttfa_p50_s=0.2, sets=(), loaded_step_ms_by_rows={},
                    detok_windows=(14,), saturated=levels[-1], levels=levels)  # fmt: skip
    host = calibration_host(cost, 2)  # the levels' fit, not the c=1 split (0 a stream) nor the last level alone
    assert (host["cpu_ms_per_stream"], host["cpu_ms_per_chunk"]) == (pytest.approx(20.0), pytest.approx(3.0))


def test_the_idle_background_splits_into_a_fixed_part_and_a_part_per_replica():
    assert background_split({2: 0.136, 4: 0.204}) == (pytest.approx(0.068), pytest.approx(0.034))  # 2026-12-06
    assert background_split({2: 0.14}) == (0.14, 0.0)  # one size: all of it fixed
    assert background_split({}) == (0.0, 0.0)
    assert background_split({2: 0.2, 4: 0.15}) == (pytest.approx(0.175), 0.0)  # fewer at more replicas: noise
    assert background_split({2: 0.05, 4: 0.2}) == (0.0, pytest.approx(0.045))  # through zero, never below it
    cost = HostCost(background_cores=0.136, host_ms_per_stream=10.0, host_ms_per_chunk=2.0, llm_ms_per_token=2.5,
                    detok_ms_per_chunk=12.0, ttfa_p50_s=0.2, sets=(), loaded_step_ms_by_rows={},
                    detok_windows=(14,), background_by_replicas={2: 0.136, 4: 0.204})  # fmt: skip
    host = parse_calibration({**calibration_with_steps(json.loads(CPU_CALIBRATION.read_text()), {1: 2.0}, "here"),
                              "host": calibration_host(cost, 2)}).host  # fmt: skip
    assert (host.background_for(2), host.background_for(4)) == (pytest.approx(0.136), pytest.approx(0.204))


def _level(streams: int, chunks: int, per_stream_ms: float, per_chunk_ms: float, round_index: int = 0,
           background_s: float = 0.0) -> SaturatedLoad:  # fmt: skip
    """A closed-loop level of 10 s whose host CPU is `per_stream_ms` a stream + `per_chunk_ms` a chunk
    (+ `background_s` of idle upkeep, for the tests that take it off)."""
    host_s = (streams * per_stream_ms + chunks * per_chunk_ms) / 1e3 + background_s
    return SaturatedLoad(clients=2, wall_s=10.0, streams=streams, chunks=chunks, host_cpu_s=host_s, llm_cpu_s=1.0,
                         detok_cpu_s=1.0, round=round_index)  # fmt: skip


def _rounds_disagreeing() -> tuple[SaturatedLoad, ...]:
    """Two rounds over the same streams and chunks: 20 ms a stream + 3 ms a chunk, then 40 + 4."""
    shape = ((10, 100), (20, 150), (40, 400))
    return tuple(_level(streams, chunks, *fit, round_index=index)
                 for index, fit in enumerate(((20.0, 3.0), (40.0, 4.0))) for streams, chunks in shape)  # fmt: skip


def _spread_cost(levels: tuple[SaturatedLoad, ...], samples: tuple[float, ...],
                 by_replicas: dict[int, float] | None = None) -> HostCost:  # fmt: skip
    """A measurement with the c=1 sets at 7 chunks a stream, `levels` and the idle spells' `samples`."""
    mean = sum(samples) / len(samples)
    sets = (_set("short", 10, 40, 0.18), _set("long", 10, 100, 0.30))
    return HostCost(background_cores=mean, host_ms_per_stream=10.0, host_ms_per_chunk=2.0, llm_ms_per_token=2.5,
                    detok_ms_per_chunk=12.0, ttfa_p50_s=0.2, sets=sets, loaded_step_ms_by_rows={},
                    detok_windows=(14,) * 140, saturated=levels[-1], levels=levels,
                    background_by_replicas=by_replicas or {2: mean}, background_samples=samples)  # fmt: skip


def test_each_round_of_closed_loop_levels_gets_its_own_fit():
    from loadtest.host_fit import split_host_at_load, split_host_by_round

    levels = _rounds_disagreeing()
    by_round = split_host_by_round(levels)
    assert list(by_round) == [0, 1]
    assert by_round[0] == (pytest.approx(20.0), pytest.approx(3.0))
    assert by_round[1] == (pytest.approx(40.0), pytest.approx(4.0))
    assert split_host_at_load(levels) == (pytest.approx(30.0), pytest.approx(3.5))  # the whole calibration's
    assert split_host_by_round(levels[:4]) == {0: by_round[0]}  # a round of one level has no fit of its own
    assert split_host_by_round(()) == {}
    old = SaturatedLoad(2, 10.0, 10, 100, 1.0, 1.0, 1.0)  # written before the rounds: round 0
    assert old.round == 0


def test_the_background_is_the_idle_spells_mean_taken_off_every_set_and_level():
    from loadtest.host_cost import spell_counts
    from loadtest.host_fit import host_cost_of

    assert [spell_counts(n) for n in (1, 2, 3, 5)] == [(1, 0, 0), (1, 0, 1), (1, 1, 1), (1, 3, 1)]
    with pytest.raises(ValueError):
        spell_counts(0)
    raw_sets = (_set("short", 10, 40, 2.18), _set("long", 10, 100, 2.30))  # 10 s each, the background in
    raw_levels = (_level(10, 100, 20.0, 3.0, background_s=2.0), _level(40, 400, 20.0, 3.0, 1, background_s=2.0),
                  _level(1, 1, 0.0, 0.0, 1))  # fmt: skip
    cost = host_cost_of(raw_sets, raw_levels, {1: 2.0}, (0.1, 0.2, 0.3), stage_replicas=2)
    assert cost.background_cores == pytest.approx(0.2) and cost.background_samples == (0.1, 0.2, 0.3)
    assert cost.background_by_replicas == {2: pytest.approx(0.2)}
    assert [s.host_cpu_s for s in cost.sets] == [pytest.approx(0.18), pytest.approx(0.30)]
    assert [lv.host_cpu_s for lv in cost.levels] == [pytest.approx(0.5), pytest.approx(2.0), 0.0]  # never below 0
    assert [lv.round for lv in cost.levels] == [0, 1, 1] and cost.saturated == cost.levels[-1]
    assert (cost.host_ms_per_stream, cost.host_ms_per_chunk) == (pytest.approx(10.0), pytest.approx(2.0))


def test_the_host_range_spans_the_cheapest_and_the_dearest_host_measured():
    """Rounds that disagree and idle spells that differ: `low` takes the cheaper round's fit (by a typical
    stream's host CPU, 7 chunks) and the lowest spell, `high` the dearer and the highest; `host` between."""
    from loadtest.host_fit import calibration_host_range, typical_chunks_per_stream

    cost = _spread_cost(_rounds_disagreeing(), samples=(0.10, 0.20, 0.15))
    assert typical_chunks_per_stream(cost) == pytest.approx(7.0)
    central, spread = calibration_host(cost, 2), calibration_host_range(cost, 2)

    def stream_ms(host: dict) -> float:
        return host["cpu_ms_per_stream"] + 7.0 * host["cpu_ms_per_chunk"]

    low, high = spread["low"], spread["high"]
    assert stream_ms(low) < stream_ms(central) < stream_ms(high)  # 41 < 54.5 < 68 ms a typical stream
    assert (low["cpu_ms_per_stream"], low["cpu_ms_per_chunk"]) == (pytest.approx(20.0), pytest.approx(3.0))
    assert (high["cpu_ms_per_stream"], high["cpu_ms_per_chunk"]) == (pytest.approx(40.0), pytest.approx(4.0))
    assert (low["background_cores"], central["background_cores"], high["background_cores"]) == (
        pytest.approx(0.10), pytest.approx(0.15), pytest.approx(0.20))  # fmt: skip
    assert low["cores"] == high["cores"] == 2
    # a background split by replicas scales as a whole: at the measured 1x1, the lowest spell's cores
    split = calibration_host_range(_spread_cost(_rounds_disagreeing(), (0.10, 0.20), {2: 0.15, 4: 0.25}), 2)
    per_replica = split["low"]["background_cores_per_replica"]
    assert split["low"]["background_cores"] + 2 * per_replica == pytest.approx(0.10, abs=1e-3)
    one_round = tuple(lv for lv in _rounds_disagreeing() if lv.round == 0)
    assert calibration_host_range(_spread_cost(one_round, samples=(0.15,)), 2) is None  # nothing spread
    spells_only = calibration_host_range(_spread_cost(one_round, samples=(0.1, 0.2)), 2)
    assert stream_ms(spells_only["low"]) == stream_ms(spells_only["high"])  # one round: the central fit at both


def test_the_host_range_enters_the_calibration_and_round_trips_through_its_parser():
    base = calibration_with_steps(json.loads(CPU_CALIBRATION.read_text()), {1: 2.0, 4: 3.0}, "here")
    data = calibration_with_host(base, _spread_cost(_rounds_disagreeing(), (0.10, 0.20, 0.15)), 2, "host_cost here")
    calib = parse_calibration(json.loads(json.dumps(data)))
    assert calib.host_range is not None and "host_range" in data["sources"]
    names = ("cores", "background_cores", "background_cores_per_replica", "cpu_ms_per_stream", "cpu_ms_per_chunk")
    for end in ("low", "high"):
        host = getattr(calib.host_range, end)
        assert {name: getattr(host, name) for name in names} == data["host_range"][end]
    low, high = calib.host_range.low, calib.host_range.high
    assert low.cpu_ms_per_stream < calib.host.cpu_ms_per_stream < high.cpu_ms_per_stream
    assert parse_calibration(with_assumptions(data, None, 0.15)).host_range == calib.host_range
    unspread = calibration_with_host(base, _spread_cost(_rounds_disagreeing()[:3], (0.15,)), 2, "here")
    assert "host_range" not in unspread and parse_calibration(unspread).host_range is None


def _fake_capacity(scenario: Scenario, config, slo: Slo, sim: SimOptions = SimOptions()) -> float:
    """No simulation: a capacity that falls as a stream's host CPU rises (1 req/s at 0 ms, 0.5 at 50 ms)."""
    return 1.0 / (1.0 + scenario.calib.host.cpu_ms_per_stream / 50.0)


def test_plan_check_predicts_the_least_and_most_capacity_over_the_host_range(monkeypatch):
    import loadtest.plan_check as plan_check

    monkeypatch.setattr(plan_check, "predicted_rps", _fake_capacity)
    data = json.loads(CPU_CALIBRATION.read_text())
    host = {"cores": 2, "background_cores": 0.15, "cpu_ms_per_stream": 50.0, "cpu_ms_per_chunk": 1.0}
    data.update(host=host, host_range={"low": {**host, "cpu_ms_per_stream": 0.0},
                                       "high": {**host, "cpu_ms_per_stream": 150.0}})  # fmt: skip
    scenario = Scenario(parse_calibration(data), ORPHEUS_TINY, sweep_workload())
    config, slo = CONFIGS[2], Slo(1.0)
    # the dearest host ("high") gives the least capacity, the cheapest ("low") the most
    assert plan_check.predicted_range_rps(scenario, config, slo, 0.5) == (pytest.approx(0.25), pytest.approx(1.0))
    assert plan_check.predicted_range_rps(scenario, config, slo, 1.2)[1] == 1.2  # the central one always inside
    line = plan_check.predicted_line(scenario, config, slo, SimOptions())
    assert line == "cpu-1x1-cap4: predicted 0.50 req/s, 0.25-1.00 over the host range"
    without = Scenario(parse_calibration({**data, "host_range": None}), ORPHEUS_TINY, sweep_workload())
    assert plan_check.predicted_range_rps(without, config, slo, 0.5) == (0.5, 0.5)
    assert "no host_range" in plan_check.predicted_line(without, config, slo, SimOptions())


def test_the_check_reports_the_range_and_whether_the_measured_capacity_is_in_it():
    from loadtest.plan_check import result_json

    inside = CheckResult("cpu-1x1-cap4", 1.14, 1.0, (1.0,), predicted_range_rps=(0.85, 1.3))
    assert inside.in_range and inside.verdict == "yes"  # the verdict stays on the central prediction
    above = CheckResult("cpu-1x1-cap4", 0.85, 1.07, (1.0,), predicted_range_rps=(0.7, 1.0))
    assert not above.in_range and above.verdict == "yes"
    row = report([inside, above])
    assert "least-most req/s over host_range" in row[0] and "in range" in row[0]
    assert row[2].startswith("| cpu-1x1-cap4 | 1.14 | 0.85-1.30 | 1.00 | 14% | yes | yes |")
    assert row[3].startswith("| cpu-1x1-cap4 | 0.85 | 0.70-1.00 | 1.07 | 21% | yes | no |")
    unranged = CheckResult("cpu-1x1", 1.0, 1.0, (1.0,))
    assert unranged.capacity_range_rps == (1.0, 1.0) and unranged.in_range
    assert result_json(unranged)["predicted_range_rps"] == [1.0, 1.0]
    written = json.loads(json.dumps(result_json(above)))
    assert written["predicted_range_rps"] == [0.7, 1.0] and written["in_range"] is False


def test_a_draw_reports_the_rate_it_really_offered():
    """Run i's cap4 draw at a nominal 1.229 req/s sent 89 requests in its 60 s: it offered 1.21x the rate."""
    from loadtest.plan_served import offered_rps

    assert offered_rps(89, 60.0) / 1.229 == pytest.approx(1.207, abs=1e-3)
    assert offered_rps(5, 0.0) == 0.0


def test_the_planner_on_the_checks_own_draws_gives_a_capacity_and_an_agreement():
    """Each served draw replayed through the planner (`replay`): the capacity it calls over the swept rates,
    a floor where it meets every rate swept, and the share of draws it called as served; the table shows both."""
    from loadtest.plan_check import replayed_cell, report
    from loadtest.plan_draws import replay_agreement, replayed_capacity

    def step(rate: float, served: bool, replayed: bool | None, redrawn: bool = False) -> dict:
        row = {"summary": {"rate_rps": rate}, "met": served, **({"redrawn": True} if redrawn else {})}
        return row if replayed is None else {**row, "replay": {"met": replayed}}

    steps = [
        step(1.0, True, True),
        step(1.0, True, True),
        step(1.2, True, True),
        step(1.2, True, False),
        step(1.2, False, True),
        step(1.4, False, False),
        step(1.4, False, False),
        step(1.4, True, None, True),
    ]
    assert replayed_capacity(steps) == (1.2, False)  # 1.2: two of three replayed draws meet; 1.4: none
    assert replay_agreement(steps) == pytest.approx(5 / 7)  # the redrawn draw was not replayed
    every = [step(1.0, True, True), step(1.2, False, True)]
    assert replayed_capacity(every) == (1.2, True) and replay_agreement(every) == 0.5
    assert replayed_capacity([]) == (0.0, False) and replay_agreement([]) is None
    assert replayed_capacity([step(1.0, True, False)]) == (0.0, False)
    floor = CheckResult("cpu-1x1-cap4", 1.6, 1.0, (1.0, 1.2), replayed_rps=1.2, replayed_is_floor=True,
                        replay_agreement=0.5)  # fmt: skip
    assert replayed_cell(1.2, True) == ">= 1.20" and replayed_cell(None, False) == "-"
    assert "| >= 1.20 | - | 50% |" in report([floor])[2]
    at_speed = replace(floor, replayed_at_speed_rps=1.0, replayed_at_speed_is_floor=False)
    assert "| >= 1.20 | 1.00 | 50% |" in report([at_speed])[2]
    assert replayed_capacity([{**s, "replay_at_draw_speed": {"met": True}} for s in steps[:2]],
                             "replay_at_draw_speed") == (1.0, True)  # fmt: skip


def test_replayed_draws_are_written_with_the_planners_call():
    """`replay_steps` replays every kept draw that kept its streams and leaves redrawn ones alone."""
    from cluster.planner.calibration import CALIBRATION_DIR, load_calibration
    from loadtest.plan_draws import replay_steps

    scenario = Scenario(load_calibration(CALIBRATION_DIR / "cpu-orpheus-tiny.json"), ORPHEUS_TINY, sweep_workload())
    frame_s = 2048 / 24_000
    streams = [{"scheduled_at_s": 10.0 * k, "text_chars": 60, "arrivals_s": [0.3 + 0.1 * j for j in range(20)],
                "durations_s": [4 * frame_s] * 20, "is_ok": True} for k in range(4)]  # fmt: skip
    steps = [{"summary": {"rate_rps": 0.1}, "draw": 0, "met": True, "requests": streams},
             {"summary": {"rate_rps": 0.1}, "draw": 1, "met": True, "requests": streams, "redrawn": True},
             {"summary": {"rate_rps": 0.1}, "draw": 2, "met": True}]  # fmt: skip
    cap4 = next(c for c in CONFIGS if c.name == "cpu-1x1-cap4")
    replay_steps(steps, scenario, cap4, Slo(1.0), SimOptions(seeds=1))
    assert steps[0]["replay"]["met"] is True and "replay" not in steps[1] and "replay" not in steps[2]
    assert "replay_at_draw_speed" not in steps[0]  # no calibration step given: not replayed at the draw's speed


def test_a_draw_is_replayed_at_its_own_speed_too():
    """With the calibration's LLM step probe, each draw is replayed again with its steps scaled to the box's speed
    probed around it: the same light arrivals meet at the calibration's speed and miss on a box 30x slower."""
    from cluster.planner.calibration import CALIBRATION_DIR, load_calibration
    from loadtest.plan_draws import draw_speed_scale, replay_steps

    assert draw_speed_scale({"box_step_ms": 3.3}, 3.0) == pytest.approx(1.1)
    assert draw_speed_scale({}, 3.0) == 0.0 and draw_speed_scale({"box_step_ms": 3.3}, 0.0) == 0.0
    scenario = Scenario(load_calibration(CALIBRATION_DIR / "cpu-orpheus-tiny.json"), ORPHEUS_TINY, sweep_workload())
    frame_s = 2048 / 24_000
    streams = [{"scheduled_at_s": 10.0 * k, "text_chars": 60, "arrivals_s": [0.3 + 0.1 * j for j in range(20)],
                "durations_s": [4 * frame_s] * 20, "is_ok": True} for k in range(4)]  # fmt: skip
    steps = [{"summary": {"rate_rps": 0.1}, "draw": draw, "met": True, "requests": streams, "box_step_ms": probed}
             for draw, probed in enumerate((90.0, 3.0))]  # fmt: skip
    cap4 = next(c for c in CONFIGS if c.name == "cpu-1x1-cap4")
    replay_steps(steps, scenario, cap4, Slo(1.0), SimOptions(seeds=1), calibration_step_ms=3.0)
    slow, on_speed = steps[0]["replay_at_draw_speed"], steps[1]["replay_at_draw_speed"]
    assert steps[0]["replay"]["met"] and not slow["met"] and slow["scale"] == 30.0
    assert on_speed["met"] and on_speed["scale"] == 1.0 and on_speed["p90_ttfa_s"] == steps[1]["replay"]["p90_ttfa_s"]

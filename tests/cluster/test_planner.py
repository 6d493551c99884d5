"""The capacity planner's model: calibration tables, chunk cutting, and the physics a sizing rests on."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from cluster.planner import search
from cluster.planner.calibration import CALIBRATION_DIR, available, find_calibration, parse_calibration
from cluster.planner.predict import Scenario, predict
from cluster.planner.search import (
    MAX_AUTO_DRAWS,
    Slo,
    capacity_streams,
    draws_for,
    majority_meets,
    meets_slo,
    size_cluster,
    zero_load_ttfa_s,
)
from cluster.planner.simulate import ClusterShape, SimOptions
from cluster.planner.workload import ChunkRule, ModelRates, Workload, make_streams
from core.config import DetokConfig
from core.errors import InvalidArgumentError
from llm_stage.registry import load_family

ORPHEUS = ModelRates(24000 / 2048, 7)
FAST = SimOptions(min_measured=20)

SMALL = {  # a made-up device: cheap to simulate (few slots, short streams), costs like the CPU preset's
    "gpu": "test", "model": "orpheus-test", "family": "orpheus", "device": "made up in tests",
    "llm": {
        "step_ms": {"rows": [1, 4, 8], "cache_tokens": [100], "ms": [[5.0], [6.0], [8.0]]},
        "kv_bytes_per_token": 0, "memory_bandwidth_bytes_per_s": 1e10, "prefill_ms_per_token": 0.02,
        "pipeline_step_factor": 1.0, "max_streams_per_replica": 8,
    },
    "detok": {"batch_frames": [1, 64], "ms": [2.0, 20.0], "max_batch_chunks": 16},
    "transfer": {"llm_to_detok_s": 0.005, "detok_to_client_s": 0.01},
    "schedule": {"first_chunk_frames": 2, "chunk_frames": 8, "left_context_frames": 3, "right_context_frames": 3,
                 "adaptive": True},
    "sources": {"all": "made up"},
}  # fmt: skip
SHORT_TEXTS = Workload(text_chars=(30,))  # 2 s of audio


def small_scenario(**changes: dict) -> Scenario:
    data = copy.deepcopy(SMALL)
    for section, fields in changes.items():
        data[section].update(fields)
    return Scenario(parse_calibration(data), ORPHEUS, SHORT_TEXTS)


# calibration


def test_bundled_calibrations_parse_and_match_the_registry():
    assert ("h200", "orpheus-3b") in available() and ("cpu", "orpheus-tiny") in available()
    for gpu, model in available():
        calib = find_calibration(gpu, model)
        assert calib.sources and calib.family == "orpheus"
        family = load_family(calib.family)
        assert (family.frame_rate_hz, family.lm.tokens_per_frame) == (ORPHEUS.frame_rate_hz, 7)


def test_step_table_hits_its_points_interpolates_and_extends():
    step = find_calibration("h200", "orpheus-3b").llm_step
    at = step.step_ms(np.asarray([1, 128, 192, 1024, 0]), np.full(5, 233.0))
    assert at[0] == pytest.approx(4.11) and at[1] == pytest.approx(7.05)
    assert at[2] == pytest.approx((7.05 + 10.49) / 2)
    assert at[3] == pytest.approx(18.87 + 512 * (18.87 - 10.49) / 256)  # past 512 rows: the last segment's slope
    assert at[4] == 0.0
    longer = step.step_ms(np.asarray([128]), np.asarray([1233.0]))[0]
    assert longer - 7.05 == pytest.approx(128 * 1000 * 114688 / 4.3e12 * 1e3)  # the KV read at the memory bound


def test_step_table_with_two_cache_columns_interpolates_between_them():
    data = copy.deepcopy(SMALL)
    data["llm"]["step_ms"] = {"rows": [1, 8], "cache_tokens": [100, 300], "ms": [[5.0, 7.0], [8.0, 12.0]]}
    step = parse_calibration(data).llm_step
    assert step.step_ms(np.asarray([1, 8]), np.asarray([200.0, 300.0])).tolist() == pytest.approx([6.0, 12.0])


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("llm", "step_ms"), None, "llm.step_ms"),
        (("llm", "step_ms", "rows"), [4, 1, 8], "llm.step_ms.rows"),
        (("llm", "step_ms", "ms"), [[5.0]], "llm.step_ms.ms"),
        (("llm", "pipeline_step_factor"), 0, "llm.pipeline_step_factor"),
        (("detok", "ms"), [1.0], "detok.ms"),
        (("transfer", "llm_to_detok_s"), "fast", "transfer.llm_to_detok_s"),
        (("schedule", "chunk_frames"), -2, "schedule.chunk_frames"),
    ],
)
def test_bad_calibration_names_the_field(path, value, field):
    data = copy.deepcopy(SMALL)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    with pytest.raises(InvalidArgumentError) as err:
        parse_calibration(data)
    assert err.value.field == field


def test_calibration_files_say_where_every_section_came_from():
    for path in CALIBRATION_DIR.glob("*.json"):
        sources = json.loads(path.read_text())["sources"]
        assert {"llm.step_ms", "detok", "transfer", "schedule"} <= set(sources), path.name


# chunks


def test_chunk_rule_follows_the_engines_schedule_and_caps_by_the_buffer():
    rule = ChunkRule.from_spec(find_calibration("h200", "orpheus-3b").schedule)
    assert DetokConfig().first_chunk_frames == 2 and DetokConfig().chunk_frames == 8
    assert rule.planned_size(np.arange(5)).tolist() == [2, 4, 8, 8, 8]
    seq = np.asarray([0, 1, 2, 2])
    budget = np.asarray([0, 3, 20, -1])
    assert rule.next_size(seq, budget).tolist() == [2, 3, 8, 2]  # seq 0 as planned; a spent buffer restarts


# physics


@pytest.mark.parametrize("step_scale", [1.0, 1.5])
def test_zero_load_ttfa_is_the_first_chunks_compute(step_scale):
    scenario = Scenario(find_calibration("h200", "orpheus-3b"), ORPHEUS)
    options = SimOptions(min_measured=20, step_scale=step_scale)
    alone = predict(scenario, 0.02, ClusterShape(1, 1, 256), options)
    assert alone.p50_ttfa_s == pytest.approx(zero_load_ttfa_s(scenario, options), abs=1e-9)
    assert alone.viable_pct == 100.0


def test_more_streams_take_longer_to_first_audio():
    scenario = small_scenario()
    shape = ClusterShape(2, 1, 8)
    light, heavy = (predict(scenario, n, shape, FAST) for n in (2, 14))
    assert heavy.p90_ttfa_s > light.p90_ttfa_s
    assert heavy.llm_load > light.llm_load and heavy.slot_use > light.slot_use


def test_a_load_meets_the_slo_when_most_poisson_draws_do(monkeypatch):
    """One draw's p90 swings with its bursts: a load is met when most of `seeds` draws meet the SLO,
    and the draws stop once the majority is decided."""
    tried: list[int] = []

    def fake_predict(scenario, streams, shape, sim):
        tried.append(sim.seed)
        return SimpleNamespace(meets=lambda ttfa_s, viable_pct: sim.seed in meeting)

    monkeypatch.setattr(search, "predict", fake_predict)
    shape, slo = ClusterShape(1, 1, 4), Slo(1.0)
    meeting = {10, 12, 13}  # seeds 10..14: 3 of 5 meet
    assert meets_slo(None, 4.0, shape, slo, SimOptions(seed=10, seeds=5))
    assert tried == [10, 11, 12, 13]  # the third met at seed 13: decided
    tried.clear()
    meeting = {10}
    assert not meets_slo(None, 4.0, shape, slo, SimOptions(seed=10, seeds=5)) and tried == [10, 11, 12, 13]
    tried.clear()
    meeting = set()  # one seed: that draw alone
    assert not meets_slo(None, 4.0, shape, slo, SimOptions(seed=10)) and tried == [10]


def test_a_load_test_draw_runs_from_an_empty_cluster_measures_every_arrival_and_has_no_tail():
    """`draw_s` > 0: arrivals over that span only, all measured (as `loadtest.sweep` measures a rate); 0: a
    warm-up and a tail around a window of at least `min_measured` arrivals."""
    scenario = small_scenario()
    workload, rates = scenario.workload, scenario.rates
    rate = 6.0 / workload.mean_audio_s(rates)
    draw = make_streams(6.0, workload, rates, seed=3, draw_s=60.0)
    assert draw.is_measured.all() and draw.arrival_s.min() >= 0 and draw.arrival_s.max() < 60.0
    assert abs(draw.count - rate * 60.0) < 4 * (rate * 60.0) ** 0.5  # Poisson at the load's rate
    steady = make_streams(6.0, workload, rates, seed=3, min_measured=20)
    measured = steady.arrival_s[steady.is_measured]
    assert not steady.is_measured.all() and measured.min() >= workload.mean_audio_s(rates) and len(measured) >= 10
    assert steady.arrival_s.max() > measured.max()  # the tail keeps the load on after the window
    with pytest.raises(InvalidArgumentError) as err:
        make_streams(6.0, workload, rates, seed=3, draw_s=-1.0)
    assert err.value.field == "draw_s"


def test_seeds_0_takes_as_many_draws_as_hold_2000_arrivals_odd_and_at_most_13():
    scenario = small_scenario()  # streams of 23 frames, 1.96 s
    assert draws_for(scenario, 4.0, SimOptions(seeds=5, draw_s=90.0)) == 5  # told
    # 4 streams of 1.96 s: 2.04 req/s, 183 arrivals a 90 s draw -> 11 draws (10.9 up)
    assert draws_for(scenario, 4.0, SimOptions(seeds=0, draw_s=90.0)) == 11
    assert draws_for(scenario, 10.0, SimOptions(seeds=0, draw_s=90.0)) == 5  # 458 a draw -> 4.4 -> 5
    assert draws_for(scenario, 12.0, SimOptions(seeds=0, draw_s=90.0)) == 5  # 550 a draw -> 3.6 -> 4 -> 5 (odd)
    assert draws_for(scenario, 1000.0, SimOptions(seeds=0, draw_s=90.0)) == 1  # a fleet's slice: one draw is the load
    assert draws_for(scenario, 0.1, SimOptions(seeds=0, draw_s=90.0)) == MAX_AUTO_DRAWS
    assert draws_for(scenario, 4.0, SimOptions(seeds=0, min_measured=100)) == 13  # steady: 100 measured a draw -> 20


def test_doubling_replicas_doubles_capacity():
    """From 2 replicas on (one replica alone cannot spread its bursts: 1 -> 2 gains ~2.6x here)."""
    scenario = small_scenario()
    slo = Slo(ttfa_p90_s=0.6)
    two = capacity_streams(scenario, ClusterShape(2, 2, 8), slo, high=64, sim=FAST)
    four = capacity_streams(scenario, ClusterShape(4, 4, 8), slo, high=128, sim=FAST)
    assert two >= 8
    assert 1.8 <= four / two <= 2.2


def test_a_slower_step_moves_the_bottleneck_from_the_detokenizer_to_the_llm():
    scenario = small_scenario(detok={"ms": [30.0, 300.0]})  # a heavy detokenizer
    shape = ClusterShape(1, 1, 8)
    base = predict(scenario, 4, shape, FAST)
    slow = predict(scenario, 4, shape, SimOptions(min_measured=20, step_scale=4.0))
    assert base.bottleneck == "detok"
    assert slow.bottleneck == "llm step"
    assert slow.p90_ttfa_s > base.p90_ttfa_s


def test_full_slots_make_admission_the_bottleneck_and_refuse_streams():
    scenario = small_scenario(llm={"max_streams_per_replica": 2})
    crowded = predict(scenario, 6, ClusterShape(1, 1, 2), SimOptions(min_measured=20, admission_wait_s=0.5))
    assert crowded.bottleneck == "admission"
    assert crowded.rejected_pct > 0 and crowded.viable_pct < 99


def test_size_cluster_meets_the_slo_and_grows_with_the_load():
    scenario = small_scenario()
    slo = Slo(ttfa_p90_s=0.6)
    small, large = (size_cluster(scenario, n, slo) for n in (4, 24))
    for plan in (small, large):
        assert plan.prediction.meets(slo.ttfa_p90_s, slo.min_viable_pct)
    assert large.llm_replicas > small.llm_replicas and large.gpus > small.gpus


def test_an_slo_under_the_zero_load_ttfa_is_refused_naming_the_field():
    with pytest.raises(InvalidArgumentError) as err:
        size_cluster(small_scenario(), 4, Slo(ttfa_p90_s=0.05))
    assert err.value.field == "ttfa_p90_s"


# admission's start limit, slots held for delivery, cores shared with the host


@pytest.mark.parametrize("limit", [1, 2, 4])
def test_the_start_limit_is_the_routers(limit):
    """The planner's vectorised stream limit and `starting_allowed`, fed the streams a measured batch keeps at
    real time, equal `router.admission.stream_limit` / `starting_allowed` on the same figures."""
    from cluster.planner.paced_admission import starting_allowed, stream_limit, sustained_streams
    from router.admission import ReplicaLoad
    from router.admission import starting_allowed as router_allowed
    from router.admission import stream_limit as router_limit

    slots = 12
    for real_time in (0.0, 1.2, 3.7, 7.0, 11.9, 30.0):
        for measured in (1, 4, 8, 12):
            rt, rows = np.asarray([real_time]), np.asarray([measured if real_time else 0])
            limit_here = stream_limit(slots, rt, rows)
            room_under = np.maximum(limit_here, sustained_streams(slots, rt))
            for live in range(0, slots + 1):
                for starting in range(0, live + 1):
                    load = ReplicaLoad(num_active=live, max_streams=slots, max_queued=8, step_s=0.01,
                                       first_chunk_tokens=49, avg_stream_s=3.0, real_time_streams=real_time,
                                       measured_streams=int(rows[0]), num_starting=starting,
                                       startup_limit=limit)  # fmt: skip
                    assert limit_here[0] == router_limit(load), (real_time, measured)
                    ours = starting_allowed(np.asarray([live]), np.asarray([starting]), room_under, limit)[0]
                    assert ours == router_allowed(load), (real_time, measured, live, starting)


def test_measured_steps_are_the_median_of_a_sizes_recent_decode_steps():
    """As `core.policy.StepSamples`: a size counts after MIN_STEP_SAMPLES decode-only steps, its figure is the
    median of the last STEP_SAMPLES_KEPT, and only fresh sizes count while any is fresh."""
    from cluster.planner.paced_admission import MeasuredSteps
    from core.policy import MIN_STEP_SAMPLES, STEP_FRESH_S

    steps = MeasuredSteps.empty(replicas=1, slots=8)
    one = np.ones(1, bool)

    def record(rows: int, step_s: float, at_s: float, decode_only: bool = True) -> None:
        steps.record(np.asarray([rows]), np.asarray([step_s]), np.asarray([at_s]), one & decode_only)

    for i in range(MIN_STEP_SAMPLES - 1):
        record(4, 0.010, i * 0.01)
    record(4, 0.5, 0.1, decode_only=False)  # a step that prefilled: not a batch's pace
    assert steps.largest_measured(np.asarray([0.1]))[0] == 0
    record(4, 0.030, 0.2)  # the third: measured, median of 10, 10, 30 ms
    real_time, rows = steps.real_time_streams(np.asarray([0.2]), real_time_step_s=0.02)
    assert rows[0] == 4 and real_time[0] == pytest.approx(4 * 0.02 / 0.010)
    for i in range(MIN_STEP_SAMPLES):
        record(8, 0.040, 0.3 + i * 0.01)
    assert steps.largest_measured(np.asarray([0.4]))[0] == 8
    for i in range(MIN_STEP_SAMPLES):
        record(2, 0.008, STEP_FRESH_S + 1.0 + i * 0.01)  # 8 and 4 went stale: the fresh size alone counts
    assert steps.largest_measured(np.asarray([STEP_FRESH_S + 1.1]))[0] == 2


def test_a_burst_is_started_in_waves_of_the_configured_size():
    """Twelve streams arriving at once on an idle replica with room for all: admission starts
    `max_starting_per_replica` (4) of them, the next 4 only once the first 4 stopped starting (their 2nd chunk
    delivered), then the last 4 (with 4 and 8 playing, half the room under 64 slots is still >= 4)."""
    from cluster.planner.simulate import run_llm_stage
    from cluster.planner.workload import Streams

    scenario = small_scenario(llm={"max_streams_per_replica": 64})
    count = 12
    streams = Streams(np.zeros(count), np.full(count, 60), np.full(count, 20), np.ones(count, bool))
    shape = ClusterShape(1, 1, 64, max_starting_per_replica=4, paced=False)
    llm = run_llm_stage(streams, shape, scenario.calib, ORPHEUS, scenario.chunk_rule(),
                        SimOptions(admission_wait_s=60.0), (0.0, 1.0))  # fmt: skip
    waves = np.unique(llm.admitted_s)
    assert len(waves) == 3
    assert [int((llm.admitted_s == t).sum()) for t in waves] == [4, 4, 4]
    second_chunk = llm.chunk_cut_s[(llm.chunk_seq == 1)]
    first_wave_started = np.sort(second_chunk)[3]  # the 4th 2nd chunk: the first wave's last start ends
    assert waves[0] == 0.0 and waves[1] >= first_wave_started


def test_a_replica_whose_measured_steps_fall_behind_admits_fewer_streams():
    """Paced admission: with a step that keeps only ~4 rows at real time, a load of 6 streams overruns the
    replica when the slots alone admit (every stream underruns); under the limit its measured steps give, it
    runs fewer at once and keeps them at real time (the rest wait for their start)."""
    scenario = small_scenario(llm={"step_ms": {"rows": [1, 4, 8], "cache_tokens": [100], "ms": [[5.0], [10.0],
                                                                                              [24.0]]}})  # fmt: skip
    options = SimOptions(min_measured=60, admission_wait_s=30.0)
    slots_only, paced = (predict(scenario, 6, ClusterShape(1, 1, 8, 4, paced=p), options) for p in (False, True))
    assert paced.slot_use < slots_only.slot_use
    assert paced.llm_load < 1.0 <= slots_only.llm_load
    assert paced.viable_pct > slots_only.viable_pct


def test_nothing_new_starts_while_a_stream_is_behind():
    """As `router.admission.stream_limit`: a replica with a stream whose client buffer is spent admits no new
    stream until it catches up; its other replica, all streams ahead, keeps its room."""
    from cluster.planner.paced_admission import MeasuredSteps
    from cluster.planner.simulate import _admit_room, _Replicas, starving

    state = _Replicas.empty(2, 4)
    state.stream[:, 0], state.first_cut_s[:, 0] = [0, 1], 0.0  # one stream each, first chunk cut at 0
    state.emitted[:, 0] = [4, 40]  # 4 frames (0.34 s) vs 40 frames (3.4 s) of audio cut
    clock = np.asarray([1.0, 1.0])  # 1 s of playback since
    assert starving(state, clock, ORPHEUS).tolist() == [True, False]
    room, _, _ = _admit_room(state, ClusterShape(2, 2, 4), MeasuredSteps.empty(2, 4), clock, ORPHEUS)
    assert room.tolist() == [0, 3]
    asked = _admit_room(state, ClusterShape(2, 2, 4), MeasuredSteps.empty(2, 4), clock, ORPHEUS, np.asarray([1]))
    assert [part.tolist() for part in asked] == [[3], [4], [False]]  # one replica asked about: its own figures
    state.first_cut_s[0, 0] = np.nan  # before its first chunk a stream is starting, not starving
    assert not starving(state, clock, ORPHEUS)[0]


def test_a_start_limit_of_one_spaces_a_bursts_starts():
    scenario = small_scenario()
    options = SimOptions(min_measured=60, admission_wait_s=30.0)
    free, one_at_a_time = (predict(scenario, 6, ClusterShape(1, 1, 8, limit), options) for limit in (0, 1))
    assert one_at_a_time.p90_ttfa_s > free.p90_ttfa_s
    assert one_at_a_time.queue_wait_p90_s > free.queue_wait_p90_s


def test_a_slot_is_held_until_the_audio_is_delivered():
    """One slot: the next stream starts only after the one before's audio reached its client, so a slower
    detokenizer (later delivery; the LLM's own pace unchanged) delays the next start."""
    data = copy.deepcopy(SMALL)
    data["llm"]["max_streams_per_replica"] = 1
    fast, slow = (Scenario(parse_calibration({**data, "detok": {**data["detok"], "ms": ms}}), ORPHEUS, SHORT_TEXTS)
                  for ms in ([2.0, 20.0], [40.0, 400.0]))  # fmt: skip
    shape = ClusterShape(1, 1, 1)
    held = SimOptions(min_measured=40, admission_wait_s=60.0, passes=2)
    quick, late = (predict(scenario, 0.6, shape, held) for scenario in (fast, slow))
    assert late.queue_wait_p90_s > quick.queue_wait_p90_s + 0.05


def test_host_section_parses_and_names_a_bad_field():
    data = copy.deepcopy(SMALL)
    assert parse_calibration(data).host.cores == 0  # absent: every stage owns its device
    data["host"] = {"cores": 2, "background_cores": 0.1, "cpu_ms_per_stream": 20, "cpu_ms_per_chunk": 3}
    host = parse_calibration(data).host
    assert (host.cores, host.background_cores, host.cpu_ms_per_stream, host.cpu_ms_per_chunk) == (2, 0.1, 20, 3)
    assert host.background_for(4) == 0.1  # no part per replica: older calibrations priced one idle server
    data["host"]["background_cores_per_replica"] = 0.03
    assert parse_calibration(data).host.background_for(4) == pytest.approx(0.1 + 4 * 0.03)
    data["host"]["background_cores_per_replica"] = "x"
    with pytest.raises(InvalidArgumentError) as err:
        parse_calibration(data)
    assert err.value.field == "host.background_cores_per_replica"
    data["host"]["background_cores_per_replica"] = 0.03
    data["host"]["cpu_ms_per_chunk"] = -1
    with pytest.raises(InvalidArgumentError) as err:
        parse_calibration(data)
    assert err.value.field == "host.cpu_ms_per_chunk"


def test_host_range_parses_as_two_host_sections_and_names_a_bad_field():
    data = copy.deepcopy(SMALL)
    assert parse_calibration(data).host_range is None  # older files: no spread measured
    host = {"cores": 2, "background_cores": 0.1, "cpu_ms_per_stream": 20, "cpu_ms_per_chunk": 3}
    data["host"] = host
    assert parse_calibration(data).host_range is None
    data["host_range"] = {"low": {**host, "background_cores": 0.05, "cpu_ms_per_stream": 5},
                          "high": {**host, "cpu_ms_per_stream": 60, "background_cores_per_replica": 0.02}}  # fmt: skip
    spread = parse_calibration(data).host_range
    assert (spread.low.background_cores, spread.low.cpu_ms_per_stream, spread.low.cpu_ms_per_chunk) == (0.05, 5, 3)
    assert spread.high.cpu_ms_per_stream == 60 and spread.high.background_for(2) == pytest.approx(0.14)
    for bad, field in [
        ("x", "host_range"),
        ({"low": data["host_range"]["low"]}, "host_range.high"),
        ({**data["host_range"], "low": {**host, "cpu_ms_per_chunk": -1}}, "host_range.low.cpu_ms_per_chunk"),
        ({**data["host_range"], "high": {**host, "background_cores_per_replica": "x"}},
         "host_range.high.background_cores_per_replica"),
    ]:  # fmt: skip
        with pytest.raises(InvalidArgumentError) as err:
            parse_calibration({**data, "host_range": bad})
        assert err.value.field == field
    without_host = {key: value for key, value in data.items() if key != "host"}
    with pytest.raises(InvalidArgumentError) as err:
        parse_calibration(without_host)
    assert err.value.field == "host_range"


def test_the_dearest_host_of_the_range_slows_the_stages_the_cheapest_speeds_them():
    data = copy.deepcopy(SMALL)
    data["detok"]["ms"] = [10.0, 100.0]
    host = {"cores": 2, "background_cores": 0.2, "cpu_ms_per_stream": 30, "cpu_ms_per_chunk": 5}
    data["host"] = host
    data["host_range"] = {"low": {**host, "background_cores": 0.05, "cpu_ms_per_stream": 5, "cpu_ms_per_chunk": 1},
                          "high": {**host, "background_cores": 0.4, "cpu_ms_per_stream": 90}}  # fmt: skip
    scenario = Scenario(parse_calibration(data), ORPHEUS, SHORT_TEXTS)
    assert scenario.with_host(scenario.calib.host_range.high).calib.host.cpu_ms_per_stream == 90
    assert scenario.with_host(scenario.calib.host_range.high).calib.llm_step == scenario.calib.llm_step
    cheapest, dearest = (predict(scenario.with_host(host), 4.0, ClusterShape(1, 1, 8), FAST)
                         for host in (scenario.calib.host_range.low, scenario.calib.host_range.high))  # fmt: skip
    assert cheapest.p50_ttfa_s < dearest.p50_ttfa_s < float("inf")


def test_the_core_share_splits_what_the_host_leaves_among_busy_processes():
    from cluster.planner.calibration import HostCost
    from cluster.planner.shared_cores import BIN_S, CoreShare

    share = CoreShare.empty(HostCost(cores=2, background_cores=0.2), horizon_s=1.0)
    t = np.asarray([0.5])
    assert share.speed(t, "llm")[0] == 1.0  # alone: a whole core
    share.detok_busy = share.busy_series(np.asarray([0.0]), np.asarray([1.0]))  # the detok replica busy throughout
    share.llm_busy = share.busy_series(np.asarray([0.0, 0.0]), np.asarray([1.0, 1.0]))  # two LLM replicas busy
    assert share.speed(t, "llm")[0] == pytest.approx((2 - 0.2) / 3)
    loaded = share.with_host_work(np.full(10, 0.4), np.empty(0))  # 10 starts at 0.4 s
    assert loaded.host_cores.sum() * BIN_S == pytest.approx(0.0)  # 0 ms a stream: nothing added
    costly = CoreShare(HostCost(2, 0.2, cpu_ms_per_stream=50.0), share.llm_busy, share.detok_busy, share.host_cores)
    loaded = costly.with_host_work(np.full(10, 0.4), np.empty(0))
    assert loaded.host_cores.sum() * BIN_S == pytest.approx(0.5)  # 10 x 50 ms of CPU
    assert loaded.speed(np.asarray([0.45]), "llm")[0] < share.speed(np.asarray([0.45]), "llm")[0]
    assert CoreShare.empty(HostCost(), 1.0).speed(t, "llm")[0] == 1.0  # cores 0: not shared


def test_a_larger_cluster_idles_at_more_and_its_busy_processes_get_less():
    from cluster.planner.calibration import HostCost
    from cluster.planner.shared_cores import CoreShare

    host = HostCost(cores=2, background_cores=0.06, background_cores_per_replica=0.035)
    t = np.asarray([0.5])
    small, large = CoreShare.empty(host, 1.0, stage_replicas=2), CoreShare.empty(host, 1.0, stage_replicas=4)
    for share in (small, large):
        share.llm_busy = share.busy_series(np.asarray([0.0, 0.0, 0.0]), np.ones(3))  # three loops busy
    assert small.speed(t, "llm")[0] == pytest.approx((2 - 0.06 - 2 * 0.035) / 3)
    assert large.speed(t, "llm")[0] == pytest.approx((2 - 0.06 - 4 * 0.035) / 3)
    data = copy.deepcopy(SMALL)
    data["detok"]["ms"] = [10.0, 100.0]
    data["host"] = {"cores": 2, "background_cores": 0.06, "background_cores_per_replica": 0.2,
                    "cpu_ms_per_stream": 30, "cpu_ms_per_chunk": 5}  # fmt: skip
    scenario = Scenario(parse_calibration(data), ORPHEUS, SHORT_TEXTS)
    upkeep = predict(scenario, 4.0, ClusterShape(1, 2, 8), FAST)
    data["host"]["background_cores_per_replica"] = 0.0
    flat = predict(Scenario(parse_calibration(data), ORPHEUS, SHORT_TEXTS), 4.0, ClusterShape(1, 2, 8), FAST)
    assert flat.p50_ttfa_s < upkeep.p50_ttfa_s < float("inf")  # each replica's idle upkeep slows the busy ones


def test_stages_sharing_few_cores_carry_less_than_stages_on_their_own():
    scenario = small_scenario(detok={"ms": [10.0, 100.0]})
    own = capacity_streams(scenario, ClusterShape(1, 1, 8), Slo(0.6), high=32, sim=FAST)
    data = copy.deepcopy(SMALL)
    data["detok"]["ms"] = [10.0, 100.0]
    data["host"] = {"cores": 2, "background_cores": 0.2, "cpu_ms_per_stream": 30, "cpu_ms_per_chunk": 5}
    shared = capacity_streams(Scenario(parse_calibration(data), ORPHEUS, SHORT_TEXTS), ClusterShape(1, 1, 8), Slo(0.6),
                              high=32, sim=FAST)  # fmt: skip
    assert 0 < shared < own


def test_capacity_is_found_to_5_pct_of_the_load_not_in_whole_streams(monkeypatch):
    """A 1x1 on the CPU preset carries ~5 streams: whole streams would be a 20% step in its capacity."""
    monkeypatch.setattr(search, "meets_slo", lambda scenario, streams, shape, slo, sim: streams <= 5.37)
    found = capacity_streams(None, ClusterShape(1, 1, 12), Slo(1.0), high=96)
    assert 0.95 * 5.37 <= found <= 5.37
    monkeypatch.setattr(search, "meets_slo", lambda scenario, streams, shape, slo, sim: streams <= 400.0)
    big = capacity_streams(None, ClusterShape(1, 1, 12), Slo(1.0), high=960)
    assert 0.95 * 400 <= big <= 400


def test_a_load_or_a_rate_is_decided_by_most_of_its_draws_as_soon_as_they_agree():
    assert majority_meets([], 3) is None
    assert majority_meets([True], 3) is None
    assert majority_meets([True, True], 3) is True  # the third draw would not change it
    assert majority_meets([False, False], 3) is False
    assert majority_meets([True, False], 3) is None
    assert majority_meets([True, False, False], 3) is False
    assert majority_meets([False], 1) is False and majority_meets([True], 1) is True


# the steps' spread

SPREAD = {"spell_s": 0.5, "spells": [0.8, 1.2], "steps": [0.8, 0.8, 0.8, 1.6]}


@pytest.mark.parametrize(
    "change, field, message",
    [({"spells": [1.0]}, "llm.step_spread.spells", "at least 2"),
     ({"steps": [0.5, -1.0]}, "llm.step_spread.steps", "positive"),
     ({"steps": [0.5, 0.6]}, "llm.step_spread.steps", "average 1"),
     ({"spells": "wide"}, "llm.step_spread.spells", "a list"),
     ({"steps": [0.5, True]}, "llm.step_spread.steps", "positive numbers"),
     ({"spell_s": 0}, "llm.step_spread.spell_s", "> 0")],
)  # fmt: skip
def test_a_bad_step_spread_is_refused_naming_the_field(change, field, message):
    data = copy.deepcopy(SMALL)
    data["llm"]["step_spread"] = {**SPREAD, **change}
    with pytest.raises(InvalidArgumentError) as err:
        parse_calibration(data)
    assert err.value.field == field and message in str(err.value)


def test_a_step_spread_is_scaled_to_average_exactly_one_and_is_optional():
    assert parse_calibration(copy.deepcopy(SMALL)).llm_step_spread is None
    data = copy.deepcopy(SMALL)
    data["llm"]["step_spread"] = {**SPREAD, "steps": [0.6, 0.9, 1.51]}  # mean 1.0033: rounding, scaled away
    spread = parse_calibration(data).llm_step_spread
    assert np.mean(spread.steps) == pytest.approx(1.0, abs=1e-12)
    assert spread.steps[0] == pytest.approx(0.6 / 1.0033333333)
    assert spread.spells == (0.8, 1.2) and spread.spell_s == 0.5


def test_step_factors_keep_a_spell_for_its_span_and_average_one():
    from cluster.planner.calibration import StepSpread
    from cluster.planner.simulate import StepDraws

    draws = StepDraws(StepSpread(0.5, (0.5, 1.5), (1.0, 1.0)), replicas=2, seed=0)  # steps all alike: spells show
    first = draws.factors(np.asarray([0.0, 0.1]))
    assert set(first) <= {0.5, 1.5}
    assert draws.factors(np.asarray([0.49, 0.3])).tolist() == first.tolist()  # the same spells
    seen = np.concatenate([draws.factors(np.asarray([t, t])) for t in np.arange(0.5, 2000.0, 0.5)])
    assert set(seen) == {0.5, 1.5} and seen.mean() == pytest.approx(1.0, abs=0.03)
    steps = StepDraws(StepSpread(0.5, (1.0, 1.0), (0.8, 0.8, 0.8, 1.6)), replicas=1, seed=0)
    within = np.concatenate([steps.factors(np.asarray([0.1])) for _ in range(4000)])  # one spell, many steps
    assert np.median(within) == 0.8 and within.mean() == pytest.approx(1.0, abs=0.03)


def test_slow_spells_drain_the_buffers_a_steady_step_keeps_and_no_spread_changes_nothing():
    """Every step 11 ms at any rows, 0.9 of the real-time step: steady, every stream plays; drawn in 1 s spells
    of x0.5 / x1.5 (the same mean), a slow spell runs 1.35x real time and drains the buffers the streams hold,
    so streams underrun. A calibration without a spread is priced the same with the option on or off."""
    table = {"rows": [1, 8], "cache_tokens": [100], "ms": [[11.0], [11.0]]}
    spread = {"spell_s": 1.0, "spells": [0.5, 1.5], "steps": [1.0, 1.0]}
    shape, options = ClusterShape(1, 1, 8, 4, paced=False), SimOptions(min_measured=60, admission_wait_s=30.0)
    spelled = small_scenario(llm={"step_ms": table, "step_spread": spread})
    with_spells, steady = (predict(spelled, 2, shape, replace(options, step_spread=on)) for on in (True, False))
    assert steady.viable_pct == 100.0 and steady.worst_underrun_s == 0.0
    assert with_spells.viable_pct < 90.0 and with_spells.worst_underrun_s > 0.2
    plain = small_scenario(llm={"step_ms": table})
    assert predict(plain, 2, shape, options) == steady

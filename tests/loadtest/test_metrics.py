"""DESIGN §1 metrics on hand-made chunk arrival lists: TTFA, lateness, viability, underrun, capacity."""

from __future__ import annotations

import math
import random

import pytest

from loadtest.metrics import (
    RateSummary,
    RequestRecord,
    capacity_at_slo,
    chunk_lateness_s,
    is_viable,
    percentile,
    stream_speed_x,
    summarize,
    ttfa_s,
    worst_underrun_s,
)
from loadtest.serve_voxray import CPU_CONFIG
from loadtest.workload import arrival_offsets_s, check_target, is_loopback, max_tokens_for


def rec(arrivals: list[float], durations: list[float], ok: bool = True) -> RequestRecord:
    return RequestRecord(arrivals_s=arrivals, durations_s=durations, is_ok=ok, error="" if ok else "UNAVAILABLE")


def test_ttfa_is_first_non_empty_chunk():
    assert ttfa_s([0.1, 0.3, 0.5], [0.0, 0.2, 0.2]) == 0.3
    assert ttfa_s([0.1], [0.0]) is None


def test_chunk_on_time_iff_buffered_audio_covers_elapsed_time():
    # t0 = 0.2 with 0.5 s buffered; chunk 1 at 0.7 (elapsed 0.5 == buffered: on time), chunk 2 at 1.3 (late by 0.1)
    arrivals, durations = [0.2, 0.7, 1.3], [0.5, 0.5, 0.5]
    assert chunk_lateness_s(arrivals, durations) == pytest.approx([0.0, 0.1])
    assert worst_underrun_s(arrivals, durations) == pytest.approx(0.1)
    assert not is_viable(rec(arrivals, durations))
    assert is_viable(rec([0.2, 0.7, 1.2], durations))


def test_empty_chunks_are_ignored_and_underrun_floors_at_zero():
    arrivals, durations = [0.1, 0.2, 0.3, 5.0], [0.0, 1.0, 1.0, 0.0]
    assert chunk_lateness_s(arrivals, durations) == pytest.approx([-0.9])
    assert worst_underrun_s(arrivals, durations) == 0.0
    assert is_viable(rec(arrivals, durations))


def test_failed_or_silent_requests_are_not_viable_and_count_as_infinite_ttfa():
    records = [rec([0.2, 0.4], [0.5, 0.5]), rec([], [], ok=False), rec([0.3], [0.0])]
    summary = summarize(1.0, records)
    assert summary.num_requests == 3 and summary.num_ok == 2
    assert summary.pct_viable == pytest.approx(100 / 3)
    assert summary.ttfa_p50_s == math.inf and summary.to_json()["ttfa_p50_s"] is None
    assert summary.errors == {"UNAVAILABLE": 1}


def test_stream_speed():
    assert stream_speed_x([0.0, 1.0, 2.0], [1.0, 2.0, 2.0]) == pytest.approx(2.0)
    assert stream_speed_x([0.0], [1.0]) is None


def test_percentile_matches_numpy_linear_interpolation():
    values = [0.5, 0.1, 0.4, 0.2, 0.3]
    assert percentile(values, 50) == pytest.approx(0.3)
    assert percentile(values, 90) == pytest.approx(0.46)
    assert percentile([1.0, math.inf], 90) == math.inf
    assert percentile([], 90) is None


def summary_at(rate: float, ttfa: float, viable: bool) -> RateSummary:
    late = 0.0 if viable else 0.5
    return summarize(rate, [rec([ttfa, ttfa + 1.0 + late], [1.0, 1.0]) for _ in range(10)])


def test_capacity_is_highest_rate_meeting_slo_with_all_lower_rates_meeting_it():
    sweep = [summary_at(0.5, 0.2, True), summary_at(1.0, 0.4, True), summary_at(2.0, 0.9, True)]
    assert capacity_at_slo(sweep, slo_ttfa_p90_s=0.5) == 1.0
    assert capacity_at_slo(sweep, slo_ttfa_p90_s=1.0) == 2.0
    broken = [summary_at(0.5, 0.2, True), summary_at(1.0, 0.2, False), summary_at(2.0, 0.2, True)]
    assert capacity_at_slo(broken, slo_ttfa_p90_s=0.5) == 0.5
    assert capacity_at_slo(broken, slo_ttfa_p90_s=0.5, min_pct_viable=0.0) == 2.0
    assert capacity_at_slo([summary_at(0.5, 0.9, True)], slo_ttfa_p90_s=0.5) == 0.0


@pytest.mark.parametrize("process", ["poisson", "gamma"])
def test_arrivals_are_bounded_in_count_and_time(process):
    rng = random.Random(0)
    offsets = arrival_offsets_s(2.0, 10.0, 3, 50, rng, process)
    assert 3 <= len(offsets) <= 50 and offsets == sorted(offsets)
    assert all(t <= 10.0 for t in offsets[3:])
    assert len(arrival_offsets_s(1000.0, 10.0, 3, 50, rng, process)) == 50
    assert len(arrival_offsets_s(0.01, 1.0, 3, 50, rng, process)) == 3


def test_poisson_mean_rate_and_gamma_burstiness():
    rng = random.Random(1)
    poisson = arrival_offsets_s(1.0, 4000.0, 1, 10_000, rng, "poisson")
    gamma = arrival_offsets_s(1.0, 4000.0, 1, 10_000, rng, "gamma", gamma_cv=2.0)
    for offsets in (poisson, gamma):
        assert len(offsets) / offsets[-1] == pytest.approx(1.0, rel=0.1)
    gaps = [b - a for a, b in zip(gamma, gamma[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv == pytest.approx(2.0, rel=0.2)


def test_bad_arrival_arguments_name_the_field():
    with pytest.raises(ValueError, match="rate_rps"):
        arrival_offsets_s(0.0, 1.0, 1, 1, random.Random(0))
    with pytest.raises(ValueError, match="process"):
        arrival_offsets_s(1.0, 1.0, 1, 1, random.Random(0), "uniform")


def test_loopback_guard():
    assert is_loopback("127.0.0.1:9000") and is_loopback("localhost:9000") and is_loopback("[::1]:9000")
    assert not is_loopback("10.1.2.3:9000")
    with pytest.raises(ValueError, match="allow-remote"):
        check_target("10.1.2.3:9000", allow_remote=False)
    check_target("10.1.2.3:9000", allow_remote=True)


def test_max_tokens_follow_text_length_in_whole_frames():
    assert max_tokens_for("Tom!") == 8 * 7
    assert max_tokens_for("x" * 1000) == 48 * 7
    assert max_tokens_for("x" * 40) % 7 == 0


def test_max_tokens_follow_the_served_family_frame_rate():
    from loadtest.sweep import SweepConfig

    text = "x" * 40  # 31 Orpheus frames = 2.65 s of audio
    assert max_tokens_for(text) == 31 * 7
    assert max_tokens_for(text, frame_rate_hz=25.0, steps_per_frame=1) == round(31 / (24000 / 2048) * 25)
    cosy = SweepConfig(voice="", frame_rate_hz=25.0, steps_per_frame=1)
    assert cosy.max_tokens(text) == 66 and SweepConfig(max_tokens_cap=10).max_tokens(text) == 10


def test_replica_ratios_parse_and_write_a_config(tmp_path):
    import argparse

    import yaml

    from core.config import ServeConfig
    from loadtest.replica_ratio import parse_ratio, ratio_config

    assert parse_ratio("1:3") == (1, 3)
    for bad in ("1", "0:1", "a:b", "1:-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="--ratios"):
            parse_ratio(bad)
    path = ratio_config(CPU_CONFIG, "cosyvoice2-tiny", 1, 3, tmp_path)
    config = ServeConfig.model_validate(yaml.safe_load(path.read_text()))
    assert config.engine.model.name == "cosyvoice2-tiny"
    assert (config.llm.num_replicas, config.detok.num_replicas, config.detok.autoscaling) == (1, 3, False)

"""flow_bench runs end to end on the tiny shapes (no timing asserted: the figures go to BENCHMARKS.md)."""

from __future__ import annotations

from loadtest.flow_bench import build, history_rows, ms_per_audio_s, ops_per_round, per_chunk_curve


def test_rtf_row_counts_all_audio():
    codec = build("tiny")
    row = ms_per_audio_s(codec, batch=2, tokens=9, chunk=4)
    assert row["audio_s"] == round(2 * 9 * 960 / 24000, 2)
    assert row["peak_cache_mb_per_request"] > 0 and row["cpu_ms_per_audio_s"] > 0


def test_per_chunk_curve_has_a_row_per_chunk():
    rows = per_chunk_curve(build("tiny", steps=2), tokens=12, chunk=4)
    assert [r["tokens_so_far"] for r in rows] == [4, 8, 12]


def test_ops_row_counts_the_round_and_its_flow():
    codec = build("tiny", steps=2)
    one, four = ops_per_round(codec, 1, 4), ops_per_round(codec, 4, 4)
    assert 0 < one["flow_ops"] < one["round_ops"]
    assert four["flow_ops"] == one["flow_ops"]  # one forward per Euler step, whatever the batch
    assert not codec._states  # the bench's streams were released


def test_history_rows_compare_a_bounded_history_with_the_exact_one():
    exact, bounded = history_rows("tiny", tokens=60, sink=8, window=8)
    assert exact["max_abs_diff_vs_exact"] == 0 and bounded["max_abs_diff_vs_exact"] > 1e-3
    assert bounded["peak_cache_mb"] < exact["peak_cache_mb"]

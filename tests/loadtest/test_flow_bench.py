"""flow_bench runs end to end on the tiny shapes (no timing asserted: the figures go to BENCHMARKS.md)."""

from __future__ import annotations

from loadtest.flow_bench import build, ms_per_audio_s, per_chunk_curve


def test_rtf_row_counts_all_audio():
    codec = build("tiny")
    row = ms_per_audio_s(codec, batch=2, tokens=9, chunk=4)
    assert row["audio_s"] == round(2 * 9 * 960 / 24000, 2)
    assert row["peak_cache_mb_per_request"] > 0 and row["cpu_ms_per_audio_s"] > 0


def test_per_chunk_curve_has_a_row_per_chunk():
    rows = per_chunk_curve(build("tiny", steps=2), tokens=12, chunk=4)
    assert [r["tokens_so_far"] for r in rows] == [4, 8, 12]

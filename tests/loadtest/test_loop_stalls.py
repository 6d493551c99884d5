"""The loop-stall summary (`loadtest.loop_stalls.loop_share`) on a hand-built trace."""

from __future__ import annotations

import pytest

from loadtest.loop_stalls import loop_share, mean_cycle_ms_by_size


def trace(steps: list[tuple], gc: list[tuple[float, float]] = ()) -> dict:
    """(start, step, gap, size[, decode only]) per step."""
    return {
        "start_s": [s[0] for s in steps], "step_s": [s[1] for s in steps], "gap_s": [s[2] for s in steps],
        "size": [s[3] for s in steps], "decode_only": [s[4] if len(s) > 4 else True for s in steps],
        "gc_start_s": [g[0] for g in gc], "gc_pause_s": [g[1] for g in gc],
        "gc_generation": [2 for _ in gc], "now_s": 100.0,
    }  # fmt: skip


def test_a_cycle_far_past_its_sizes_median_is_a_stall_with_its_excess_counted():
    steps = [(1.0 + 0.01 * i, 0.002, 0.0, 2) for i in range(40)]
    steps.append((2.0, 0.002, 0.05, 2))  # a 50 ms gap before a 2 ms step
    steps.append((2.1, 0.030, 0.0, 2))  # a 30 ms step
    steps += [(3.0 + 0.01 * i, 0.004, 0.0, 4) for i in range(10)]
    share = loop_share(trace(steps, gc=[(2.05, 0.02), (9.0, 0.5)]), 1.0, 5.0, line_ms=lambda n: 1.0 * n)
    assert share.steps == 52
    assert share.stall_excess_ms == (50.0, 28.0)
    assert share.stalls_per_s == pytest.approx(2 / 4.0)
    assert share.gap_share == pytest.approx(0.05 / 4.0)
    assert share.gc_pauses_per_s == pytest.approx(1 / 4.0)  # the one at 9.0 s is outside
    assert share.gc_longest_ms == pytest.approx(20.0)
    two, four = share.by_size
    assert (two.size, two.count, two.median_ms, two.line_ms) == (2, 42, pytest.approx(2.0), 2.0)
    assert two.mean_cycle_ms == pytest.approx(1e3 * (42 * 0.002 + 0.05 + 0.028) / 42)
    assert (four.size, four.count) == (4, 10)


def test_steps_outside_the_window_are_left_out():
    steps = [(0.5, 0.002, 0.0, 1), (1.5, 0.002, 0.0, 1), (6.0, 0.002, 0.0, 1)]
    share = loop_share(trace(steps), 1.0, 5.0)
    assert share.steps == 1 and share.by_size[0].line_ms is None


def test_each_sizes_mean_cycle_counts_its_gaps_and_tails_once_it_stepped_often_enough():
    steps = [(float(i), 0.002, 0.0, 1) for i in range(9)] + [(9.0, 0.012, 0.006, 1)]
    steps += [(20.0, 0.004, 0.0, 2)] * 3  # too few
    steps += [(30.0, 0.050, 0.0, 1, False)] * 6  # steps that prefilled: priced apart
    assert mean_cycle_ms_by_size(trace(steps), min_steps=5) == {1: pytest.approx((9 * 2 + 18) / 10)}



def test_what_held_streams_back_is_read_from_the_replicas_sampled_load():
    from loadtest.loop_stalls import admission_share
    from router.admission import ReplicaLoad

    base = ReplicaLoad(num_active=2, max_streams=12, max_queued=2, step_s=0.002, first_chunk_tokens=28,
                       avg_stream_s=3.0, real_time_streams=20.0, measured_streams=8)  # fmt: skip
    room = base.to_stats()
    detok_full = {**room, "num_active": 4, "detok_real_time_streams": 5.0}  # floor(0.85 * 5) = 4
    starving = {**room, "num_active": 3, "num_starving": 1}
    starts_full = {**room, "num_active": 1, "num_starting": 1, "startup_limit": 1}
    share = admission_share([room, detok_full, starving, starts_full, {"not": "a load"}])
    assert share.samples == 4
    assert (share.full, share.full_by_detok, share.full_by_starving, share.full_by_pace) == (0.5, 0.25, 0.25, 0.0)
    assert share.starts_full == 0.25 and share.mean_detok_limit == 4.0
    assert (share.mean_measured_rows, share.mean_real_time_streams) == (8.0, 20.0)  # what the pace was read from
    assert admission_share([]).samples == 0


def test_a_stages_cpu_is_counted_per_second_its_loops_were_busy():
    from loadtest.host_cost import DETOK_ROLE, LLM_ROLE
    from loadtest.loop_stalls import stage_cpu

    loops = {"llm": {"a": {"step_share": 0.5, "span_s": 10.0}, "b": {"step_share": 0.3, "span_s": 10.0}},
             "detok": {"c": {"step_share": 0.0, "span_s": 10.0}}}  # fmt: skip
    spent_s = {LLM_ROLE: 12.0, DETOK_ROLE: 1.0, "router": 2.0, "client": 1.0}
    cpu = stage_cpu(spent_s, 10.0, loops)
    assert cpu["llm_cores"] == 1.2 and cpu["llm_cpu_per_busy_s"] == 1.5  # 12 CPU s over 8 busy loop seconds
    assert cpu["detok_cores"] == 0.1 and cpu["detok_cpu_per_busy_s"] == 0.0  # never busy: no ratio
    assert cpu["other_cores"] == 0.3


def test_the_cycles_spread_is_kept_as_spells_and_the_steps_within_them():
    """Half-second windows of 2-row steps alternating slow (6 ms cycles) and fast (2 ms), and within each
    window one step in four twice the others: the spells are the windows' means over the size's mean, the
    steps each cycle over its window's mean, both scaled to average 1; idle windows (few steps) and steps
    that prefilled are left out."""
    from loadtest.loop_stalls import cycle_spread

    steps = []
    for window in range(8):
        base_s = 0.003 if window % 2 else 0.001  # slow windows: 3 ms steps + 3 ms gaps
        steps += [(window * 0.5 + 0.02 * i, base_s * (2 if i % 4 == 3 else 1), base_s if i % 4 != 3 else 0.0, 2)
                  for i in range(20)]  # fmt: skip
    steps += [(4.2, 0.5, 0.0, 2, False), (9.0, 0.002, 0.0, 2)]  # a prefill; a lone step in an idle window
    spread = cycle_spread(trace(steps), points=4, spell_s=0.5, min_steps=5)
    assert spread["spell_s"] == 0.5
    assert spread["spells"] == pytest.approx([0.5, 0.5, 1.5, 1.5], abs=1e-3)  # 2 ms vs 6 ms cycles, mean 4 ms
    assert spread["steps"] == pytest.approx([1.0, 1.0, 1.0, 1.0], abs=1e-3)  # every cycle its window's mean
    assert cycle_spread(trace(steps[:3]), min_steps=5) is None  # no size stepped often enough


def test_the_steps_spread_within_a_spell_keeps_its_skew():
    from loadtest.loop_stalls import cycle_spread

    steps = [(w * 0.5 + 0.0125 * j, 0.008 if j % 4 == 3 else 0.004, 0.0, 3)
             for w in range(5) for j in range(40)]  # 4, 4, 4, 8 ms in every window  # fmt: skip
    spread = cycle_spread(trace(steps), points=4, spell_s=0.5, min_steps=5)
    assert spread["steps"] == pytest.approx([0.8, 0.8, 0.8, 1.6], abs=1e-3)
    assert spread["spells"] == pytest.approx([1.0] * 4, abs=1e-3)


def test_late_streams_say_when_they_were_sent_and_where_they_fell_behind():
    from loadtest.loop_stalls import late_streams

    on_time = {"arrivals_s": [0.3, 0.4, 0.7], "durations_s": [0.2, 0.3, 0.5], "is_ok": True, "scheduled_at_s": 1.0}
    # first audio at 0.5 s (an empty chunk before it), 0.17 s played; the next at 0.8 s: 0.13 s late, then on time
    late = {"arrivals_s": [0.2, 0.5, 0.8, 0.9], "durations_s": [0.0, 0.17, 0.34, 0.68], "is_ok": True,
            "scheduled_at_s": 3.0}  # fmt: skip
    failed = {"arrivals_s": [0.5, 2.0], "durations_s": [0.1, 0.1], "is_ok": False, "scheduled_at_s": 0.5}
    [stream] = late_streams([late, on_time, failed])
    assert (stream.sent_s, stream.ttfa_s, stream.first_late, stream.late_chunks) == (3.0, 0.5, 1, 1)
    assert stream.worst_s == pytest.approx(0.13) and stream.played_s == (0.17, 0.34)

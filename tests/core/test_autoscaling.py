"""The SLO autoscaling decision (`core.autoscaling`): pressures from each stage's stats, the
hysteresis band, sustain and cool-downs, bounds; a tick is a call with a hand-set clock."""

from __future__ import annotations

from core.autoscaling import (
    DETOK_BUSY_SHARE,
    DETOK_MIN_SLACK_S,
    LLM_PREDICTED_TTFA_S,
    LLM_STREAM_USE,
    ScalingState,
    StageTargets,
    Thresholds,
    decide,
    pressure,
)

TH = Thresholds(scale_up_pressure=0.9, scale_down_pressure=0.45, sustain_s=2.0, up_cooldown_s=5.0, down_cooldown_s=20.0)


def _run(pressures_at: list[tuple[float, list[float]]], current: int, lo: int = 1, hi: int = 3) -> list[int]:
    """Replica counts after each (time, pressures) tick, feeding each decision's state to the next."""
    state, counts = ScalingState(), []
    for now_s, pressures in pressures_at:
        decision = decide(pressures, current, lo, hi, state, now_s, TH)
        current, state = decision.num_replicas, decision.state
        counts.append(current)
    return counts


def test_llm_pressure_is_the_worse_of_ttfa_and_stream_use() -> None:
    targets = StageTargets("llm", ttfa_target_s=1.0, stream_use_target=0.5)
    assert pressure({LLM_PREDICTED_TTFA_S: 2.0, LLM_STREAM_USE: 0.25}, targets) == 2.0
    assert pressure({LLM_PREDICTED_TTFA_S: 0.2, LLM_STREAM_USE: 0.75}, targets) == 1.5


def test_detok_pressure_grows_as_decodes_near_the_playback_deadline() -> None:
    targets = StageTargets("detok", busy_share_target=0.8, slack_target_s=0.5)
    assert pressure({DETOK_BUSY_SHARE: 0.4, DETOK_MIN_SLACK_S: 3.0}, targets) == 0.5  # busy only
    assert pressure({DETOK_BUSY_SHARE: 0.1, DETOK_MIN_SLACK_S: 0.25}, targets) == 1.5  # half the slack target left
    assert pressure({DETOK_BUSY_SHARE: 0.1, DETOK_MIN_SLACK_S: -0.5}, targets) == 3.0  # decoded late
    assert pressure({DETOK_BUSY_SHARE: 0.1}, targets) == 0.125  # no chunk with a deadline lately


def test_scale_up_waits_for_a_sustained_wish() -> None:
    ticks = [(0.0, [1.2]), (1.0, [1.2]), (2.5, [1.2])]
    assert _run(ticks, current=1) == [1, 1, 2]


def test_a_burst_that_passes_scales_nothing() -> None:
    ticks = [(0.0, [1.5]), (1.0, [0.7]), (2.0, [1.5]), (3.0, [1.5])]
    assert _run(ticks, current=1) == [1, 1, 1, 1]


def test_hysteresis_band_holds_between_thresholds() -> None:
    # two replicas at 0.3 each: one alone would carry 0.6, above the down threshold -> stay
    ticks = [(t, [0.3, 0.3]) for t in (0.0, 5.0, 30.0)]
    assert _run(ticks, current=2) == [2, 2, 2]


def test_ramp_up_then_down_with_cooldowns() -> None:
    up = [(0.0, [1.0]), (2.0, [1.0])]  # -> 2 at t=2
    still_high = [(3.0, [1.0, 1.0]), (5.5, [1.0, 1.0]), (7.5, [1.0, 1.0])]  # up cool-down ends at t=7
    low = [(10.0, [0.1, 0.1]), (12.0, [0.1, 0.1]), (21.0, [0.1, 0.1]), (28.0, [0.1, 0.1])]  # down cool-down: t=27.5
    counts = _run(up + still_high + low, current=1)
    assert counts == [1, 2, 2, 2, 3, 3, 3, 3, 2]


def test_scale_down_one_replica_at_a_time_never_below_min() -> None:
    ticks = [(0.0, [0.0, 0.0, 0.0]), (3.0, [0.0, 0.0, 0.0]), (6.0, [0.0, 0.0]), (40.0, [0.0, 0.0]), (43.0, [0.0])]
    assert _run(ticks, current=3, lo=1) == [3, 2, 2, 1, 1]
    assert _run([(0.0, [0.0, 0.0]), (10.0, [0.0, 0.0])], current=2, lo=2) == [2, 2]


def test_no_stats_holds_and_bounds_apply_at_once() -> None:
    assert _run([(0.0, []), (100.0, [])], current=2) == [2, 2]
    assert decide([0.5], 5, 1, 3, ScalingState(), 0.0, TH).num_replicas == 3
    assert decide([0.5], 1, 2, 3, ScalingState(), 0.0, TH).num_replicas == 2


def test_state_round_trips_through_policy_state() -> None:
    state = ScalingState(wish=-1, wish_since_s=3.0, last_up_s=1.0, last_down_s=float("-inf"))
    kept = {"serve_internal_key": 7, **state.to_dict()}
    assert ScalingState.from_dict(kept) == state
    assert ScalingState.from_dict({}) == ScalingState()

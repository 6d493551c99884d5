"""SLO-driven replica decisions for one stage: pure functions over the replicas' reported stats.

Each replica's stats fold into one *pressure* (1.0 = at its SLO limit): an LLM replica's from its
predicted TTFA against a target and the share of its stream (KV) capacity in use; a detok replica's
from its decode busy share and how close its decodes come to the streams' playback deadlines.
`decide` turns the pressures plus a small state (pending wish, last scale times) into a replica
count with hysteresis (a band between the up and down thresholds, a wish that must hold for
`sustain_s`) and cool-downs. `deployments.autoscaling` adapts it to Ray Serve's policy hook, which
runs it in the Serve controller: this module imports the standard library only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

# Names of the stats `record_autoscaling_stats` returns (LLMStage / DetokStage) and the policy reads.
LLM_PREDICTED_TTFA_S = "predicted_ttfa_s"  # predicted TTFA of one more stream on the replica
LLM_STREAM_USE = "stream_use"  # active streams / the streams it admits (KV slots, measured pace)
DETOK_BUSY_SHARE = "busy_share"  # decode seconds per wall second its streams need (1 = saturated)
DETOK_MIN_SLACK_S = "min_slack_s"  # least time to spare before a playback deadline, recent chunks
NO_DEADLINE_SLACK_S = 60.0  # min_slack_s of a replica with no recent chunk that had a deadline


@dataclass(frozen=True)
class StageTargets:
    """What `pressure` weighs a replica's stats against (one stage's SLO)."""

    stage: str  # "llm" or "detok"
    ttfa_target_s: float = 1.0  # LLM: predicted TTFA that counts as full
    stream_use_target: float = 0.85  # LLM: share of admitted-stream capacity that counts as full
    busy_share_target: float = 0.8  # detok: decode busy share that counts as full
    slack_target_s: float = 0.5  # detok: time to spare before a deadline under which it counts as full


@dataclass(frozen=True)
class Thresholds:
    """Hysteresis and cool-downs of the decision."""

    scale_up_pressure: float = 0.9  # mean pressure above which one more replica is wanted
    scale_down_pressure: float = 0.45  # the others' mean pressure after one leaves must stay below this
    sustain_s: float = 3.0  # a wish must hold this long before it is acted on
    up_cooldown_s: float = 10.0  # after any scaling, no scale-up for this long
    down_cooldown_s: float = 30.0  # after any scaling, no scale-down for this long


@dataclass(frozen=True)
class ScalingState:
    """What the decision remembers between ticks (kept in Serve's policy_state as plain values)."""

    wish: int = 0  # +1 / -1 / 0: the direction wanted at the last tick
    wish_since_s: float = 0.0  # since when it has been wanted
    last_up_s: float = -math.inf
    last_down_s: float = -math.inf

    def to_dict(self) -> dict:
        return {f"voxray_{k}": v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict) -> ScalingState:
        fields = {k: values[f"voxray_{k}"] for k in cls.__dataclass_fields__ if f"voxray_{k}" in values}
        return cls(**fields)


@dataclass(frozen=True)
class Decision:
    num_replicas: int
    action: str  # "up", "down" or "hold"
    reason: str  # why, for the metrics' label and the log
    mean_pressure: float
    state: ScalingState = field(default_factory=ScalingState)


def llm_pressure(stats: dict[str, float], targets: StageTargets) -> float:
    """An LLM replica's pressure: the larger of predicted TTFA / target and stream use / target."""
    ttfa = stats.get(LLM_PREDICTED_TTFA_S, 0.0) / targets.ttfa_target_s
    return max(ttfa, stats.get(LLM_STREAM_USE, 0.0) / targets.stream_use_target)


def detok_pressure(stats: dict[str, float], targets: StageTargets) -> float:
    """A detok replica's pressure: busy share / target, or its lag behind the playback deadlines:
    1 at `slack_target_s` to spare, above 1 as the slack shrinks (2 at a decode right at a deadline)."""
    busy = stats.get(DETOK_BUSY_SHARE, 0.0) / targets.busy_share_target
    slack_s = stats.get(DETOK_MIN_SLACK_S, NO_DEADLINE_SLACK_S)
    lag = 1.0 + (targets.slack_target_s - slack_s) / targets.slack_target_s if slack_s < targets.slack_target_s else 0.0
    return max(busy, lag)


def pressure(stats: dict[str, float], targets: StageTargets) -> float:
    return llm_pressure(stats, targets) if targets.stage == "llm" else detok_pressure(stats, targets)


def _wish(pressures: list[float], current: int, lo: int, hi: int, th: Thresholds) -> tuple[int, str, float]:
    """The direction the pressures ask for (+1 / -1 / 0), why, and their mean."""
    if not pressures:
        return 0, "no_stats", 0.0
    total = sum(pressures)
    mean = total / len(pressures)
    if mean > th.scale_up_pressure and current < hi:
        return 1, "pressure_high", mean
    if current > lo and current > 1 and total / (current - 1) < th.scale_down_pressure:
        return -1, "pressure_low", mean
    return 0, "in_band", mean


def decide(
    pressures: list[float], current: int, lo: int, hi: int, state: ScalingState, now_s: float, th: Thresholds
) -> Decision:
    """One tick: the replica count for `current` replicas whose reporting ones have `pressures`,
    within [lo, hi], one replica at a time (a leaving LLM replica's streams move out gradually)."""
    if current < lo or current > hi:  # bounds changed: go there at once
        target = min(max(current, lo), hi)
        return Decision(target, "up" if target > current else "down", "bounds", 0.0, ScalingState())
    wish, reason, mean = _wish(pressures, current, lo, hi, th)
    since_s = state.wish_since_s if wish == state.wish else now_s
    held = ScalingState(wish, since_s, state.last_up_s, state.last_down_s)
    if wish == 0:
        return Decision(current, "hold", reason, mean, held)
    if now_s - since_s < th.sustain_s:
        return Decision(current, "hold", "sustaining", mean, held)
    last_scale_s = max(state.last_up_s, state.last_down_s)
    cooldown_s = th.up_cooldown_s if wish > 0 else th.down_cooldown_s
    if now_s - last_scale_s < cooldown_s:
        return Decision(current, "hold", "cooldown", mean, held)
    if wish > 0:
        return Decision(current + 1, "up", reason, mean, ScalingState(0, now_s, now_s, state.last_down_s))
    return Decision(current - 1, "down", reason, mean, ScalingState(0, now_s, state.last_up_s, now_s))

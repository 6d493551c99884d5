"""The capacity at SLO as the rate where half of the draws meet it, from draws at several rates (issue 40's check).

`plan_check` decided each swept rate by most of its draws and took the highest rate met with every lower one met.
Near an admission-bound capacity that rule reads low: identical arrivals served twice flip their verdict about one
time in four and one 90 s draw's p90 TTFA spans 3x (diary, run j), so an ascending sweep stops at its first unlucky
rate, while the planner's bisection over its own draws does not stop that way. Here both sides get one estimator:
the share of draws meeting the SLO at each rate, fitted non-increasing in the rate (adjacent violators pooled,
weighted by their draws), and the rate where the fit crosses one half, interpolated between the two rates around it
(the middle of the rates fitted at exactly one half, where a pooled block sits there).
The planner's side is judged on draws shaped as the sweep's (`plan_replay.planner_sweep_draws`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from cluster.planner.search import majority_meets

HALF = 0.5


@dataclass(frozen=True)
class Crossing:
    """Where the fitted share of draws meeting the SLO crosses one half. `bound`: "" inside the swept rates,
    ">=" every rate's fitted share was at least a half (`rps` the highest rate: a floor), "<" none was (`rps` the
    lowest rate: a ceiling)."""

    rps: float
    bound: str = ""

    @property
    def is_inside(self) -> bool:
        return self.bound == ""

    def cell(self) -> str:
        return f"{self.bound + ' ' if self.bound else ''}{self.rps:.2f}"


def non_increasing_fit(shares: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares fit of `shares` (in rate order) that never rises: adjacent violators pooled
    into their weighted mean until none is left."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for share, weight in zip(shares, weights, strict=True):
        blocks.append([share, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            mean, weight_, count = blocks.pop()
            before = blocks[-1]
            total = before[1] + weight_
            before[0] = (before[0] * before[1] + mean * weight_) / total
            before[1], before[2] = total, before[2] + count
    return [mean for mean, _, count in blocks for _ in range(count)]


def half_crossing(verdicts_by_rate: dict[float, list[bool]]) -> Crossing | None:
    """The rate where the fitted share of met draws crosses one half (None: no draws)."""
    rates = sorted(rate for rate, verdicts in verdicts_by_rate.items() if verdicts)
    if not rates:
        return None
    counts = [len(verdicts_by_rate[rate]) for rate in rates]
    fitted = non_increasing_fit([sum(verdicts_by_rate[r]) / n for r, n in zip(rates, counts, strict=True)],
                                [float(n) for n in counts])  # fmt: skip
    if fitted[0] < HALF:
        return Crossing(rates[0], "<")
    at_half = [rate for rate, share in zip(rates, fitted, strict=True) if math.isclose(share, HALF)]
    if at_half and fitted[-1] < HALF:  # a pooled block sits at one half: its rates' middle
        return Crossing((at_half[0] + at_half[-1]) / 2)
    for i in range(len(rates) - 1):
        above, below = fitted[i], fitted[i + 1]
        if above >= HALF > below:
            return Crossing(rates[i] + (above - HALF) / (above - below) * (rates[i + 1] - rates[i]))
    return Crossing(rates[-1], ">=")


def verdicts_by_rate(steps: Iterable[dict], key: str | None = None) -> dict[float, list[bool]]:
    """plan_check's draws by swept rate: each served verdict (`met`), or the planner's call in `step[key]`;
    redrawn draws and draws without that call left out."""
    out: dict[float, list[bool]] = {}
    for step in steps:
        if step.get("redrawn") or (key is not None and key not in step):
            continue
        out.setdefault(step["summary"]["rate_rps"], []).append(step["met"] if key is None else step[key]["met"])
    return out


def relative_error(predicted: Crossing | None, measured: Crossing | None) -> float | None:
    """|predicted - measured| / measured where both cross inside the swept rates; None otherwise."""
    if predicted is None or measured is None or not (predicted.is_inside and measured.is_inside):
        return None
    return abs(predicted.rps - measured.rps) / measured.rps


def capacity_by_majority(by_rate: dict[float, list[bool]]) -> tuple[float, bool]:
    """The highest rate whose draws mostly meet, with every lower rate's meeting too; and whether every rate's did."""
    capacity = 0.0
    for rate in sorted(by_rate):
        if not majority_meets(by_rate[rate], len(by_rate[rate])):
            return capacity, False
        capacity = rate
    return capacity, bool(by_rate)

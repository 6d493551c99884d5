"""Admission's limits as each simulated LLM replica computes them from its own measured steps.

The real replica times every decode-only step (`core.policy.StepSamples`: the median of a batch size's last
STEP_SAMPLES_KEPT steps, once MIN_STEP_SAMPLES, the fresh sizes only) and reports the streams its largest
measured batch keeps at real time; `router.admission.stream_limit` and `starting_allowed` turn that into how
many streams run and how many start at once. `cluster.planner.simulate` records its steps here (their wall
length: on shared cores the slowed step, as the replica's timer sees it) and asks for both limits each step,
vectorised over the replicas, so a slow or contended replica admits and starts fewer streams, as the real one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.config import AdmissionConfig
from core.policy import MIN_STEP_SAMPLES, STEP_FRESH_S, STEP_SAMPLES_KEPT

REAL_TIME_MARGIN = AdmissionConfig().real_time_margin  # share of the real-time streams admission counts room in


@dataclass
class MeasuredSteps:
    """Each replica's recent decode-only steps by batch size: [replicas, slots + 1 sizes, kept samples]. A
    size's median is computed when admission reads it, not at every step (`record` runs every simulated
    step; admission reads only where a stream waits)."""

    recent_s: np.ndarray  # [R, S + 1, KEPT], nan until stepped
    count: np.ndarray  # [R, S + 1] steps recorded at each size
    last_s: np.ndarray  # [R, S + 1] when each size last stepped (-inf: never)
    median_s: np.ndarray  # [R, S + 1] the median of each size's recent steps (nan: none), where not `stale`
    stale: np.ndarray  # [R, S + 1] bool: stepped since its median was last computed

    @classmethod
    def empty(cls, replicas: int, slots: int) -> MeasuredSteps:
        sizes = (replicas, slots + 1)
        return cls(np.full((*sizes, STEP_SAMPLES_KEPT), np.nan), np.zeros(sizes, np.int64), np.full(sizes, -np.inf),
                   np.full(sizes, np.nan), np.zeros(sizes, bool))  # fmt: skip

    def record(self, rows: np.ndarray, step_s: np.ndarray, ended_s: np.ndarray, decode_only: np.ndarray) -> None:
        """One step per replica of `rows` rows lasting `step_s`, ended at `ended_s`; only decode-only steps
        with rows count (`core.policy.StepTimer.record_step`: a step that prefilled is not a batch's pace)."""
        r = np.flatnonzero(decode_only & (rows > 0))
        size = np.minimum(rows[r], self.count.shape[1] - 1)
        self.recent_s[r, size, self.count[r, size] % STEP_SAMPLES_KEPT] = step_s[r]
        self.count[r, size] += 1
        self.last_s[r, size] = ended_s[r]
        self.stale[r, size] = True

    def medians(self, r: np.ndarray, size: np.ndarray) -> np.ndarray:
        """The median of each (replica `r`, batch `size`)'s recent steps, brought up to date first."""
        stale = self.stale[r, size]
        if stale.any():
            rs, ss = r[stale], size[stale]
            kept = np.minimum(self.count[rs, ss], STEP_SAMPLES_KEPT)
            ordered = np.sort(self.recent_s[rs, ss], axis=1)  # [len(rs), KEPT], nan last
            lo, hi = ordered[np.arange(len(rs)), (kept - 1) // 2], ordered[np.arange(len(rs)), kept // 2]
            self.median_s[rs, ss] = (lo + hi) / 2  # statistics.median: the middle two averaged when even
            self.stale[rs, ss] = False
        return self.median_s[r, size]

    def largest_measured(self, clock: np.ndarray, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Per replica (of `rows`; `clock` is every replica's), the largest batch size measured (0: none):
        among the fresh sizes when any is fresh."""
        count = self.count[rows]
        measured = count >= MIN_STEP_SAMPLES
        fresh = measured & (self.last_s[rows] >= clock[rows, None] - STEP_FRESH_S)
        usable = np.where(fresh.any(axis=1, keepdims=True), fresh, measured)
        return np.where(usable, np.arange(count.shape[1]), 0).max(axis=1)

    def real_time_streams(self, clock: np.ndarray, real_time_step_s: float,
                          rows: np.ndarray | slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """(streams the largest measured batch keeps at real time, that batch's rows), per replica (of `rows`);
        (0, 0) where nothing is measured (`core.policy.StepTimer.measured_real_time_rows`)."""
        batch = self.largest_measured(clock, rows)
        median_s = self.medians(np.arange(len(clock))[rows], batch)
        has = batch > 0
        return np.where(has, batch * real_time_step_s / np.where(has, median_s, 1.0), 0.0), batch


def stream_limit(slots: int, real_time: np.ndarray, measured_rows: np.ndarray,
                 margin: float = REAL_TIME_MARGIN) -> np.ndarray:  # fmt: skip
    """`router.admission.stream_limit` vectorised, without the detok cap and the starving streams' rule (the
    simulation applies that one: `simulate.starving`): the slots until a pace is measured; then one past the
    largest measured batch while it keeps real time with the margin to spare (a probe), else the margin under
    what it keeps at real time; at least 1, at most the slots."""
    spare = margin * real_time
    paced = np.where(spare >= measured_rows, measured_rows + 1, np.floor(spare)).astype(np.int64)
    return np.minimum(np.maximum(np.where(real_time > 0, paced, slots), 1), slots)


def sustained_streams(slots: int, real_time: np.ndarray, margin: float = REAL_TIME_MARGIN) -> np.ndarray:
    """`router.admission._sustained_streams` vectorised: the margin under the measured real-time streams,
    under the slots (0: not measured)."""
    return np.minimum(slots, np.floor(margin * real_time)).astype(np.int64)


def starting_allowed(num_live: np.ndarray, num_starting: np.ndarray, room_under: np.ndarray,
                     limit: int) -> np.ndarray:  # fmt: skip
    """`router.admission.starting_allowed` vectorised: `limit` with none playing, else half the room under
    `room_under` (max of the stream limit and the sustained streams) past those playing (a starting stream
    weighs two), at least 1 and at most `limit`."""
    steady = num_live - num_starting
    room = (room_under - steady) // 2
    return np.where(steady <= 0, limit, np.minimum(np.maximum(room, 1), limit))

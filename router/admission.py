"""Admission and TTFA prediction (pure functions over replica stats).

The LLMStage replica decides admit / queue / reject with `decide`; the request router ranks
replicas with `predict_ttfa_s`. Both read the same `ReplicaLoad` the replica publishes. How
many streams a replica takes comes from its measured pace (`stream_limit`), capped by its KV
slots: a fixed count is either too cautious on a fast machine or too bold on a slow one.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass

DEFAULT_STEP_S = 0.02  # prior before the first measured step


class Admission(enum.Enum):
    ADMIT = "admit"
    QUEUE = "queue"
    REJECT = "reject"


@dataclass(frozen=True)
class ReplicaLoad:
    """What one LLM replica publishes through Serve's routing stats."""

    num_active: int  # requests in the engine (running + waiting for a slot)
    max_streams: int
    max_queued: int
    step_s: float  # EMA of one engine step
    first_chunk_tokens: int  # tokens before the first chunk can be decoded
    avg_stream_s: float  # EMA of a stream's lifetime in the engine; 0 = unknown
    real_time_streams: float = 0.0  # streams its largest measured batch keeps at real time; 0 = unknown
    measured_streams: int = 0  # streams in that batch
    real_time_margin: float = 0.85  # share of `real_time_streams` admitted (AdmissionConfig)
    num_starving: int = 0  # streams whose client buffer is spent right now
    # when the replica made this report: every report differs, so a router resets the requests it
    # counted as routed / completed since the last one even when an idle replica's load is unchanged
    reported_unix_s: float = 0.0

    def to_stats(self) -> dict:
        return asdict(self)

    @classmethod
    def from_stats(cls, stats: dict) -> ReplicaLoad | None:
        try:
            return cls(**{k: stats[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError):
            return None


def stream_limit(load: ReplicaLoad) -> int:
    """Streams the replica runs at once: its KV cap, and once its pace is measured, a margin under
    what its largest measured batch keeps at real time, probing one stream past that batch (the
    limit grows as larger batches are measured, and shrinks when steps slow down)."""
    if load.real_time_streams <= 0:
        return load.max_streams
    paced = min(math.floor(load.real_time_margin * load.real_time_streams), load.measured_streams + 1)
    if load.num_starving:  # a stream is already behind: nothing new starts until it catches up
        paced = min(paced, load.num_active)
    return max(1, min(load.max_streams, paced))


def predict_ttfa_s(load: ReplicaLoad, extra_requests: int = 0) -> float:
    """Predicted time to first audio for one more request on this replica."""
    step_s = load.step_s or DEFAULT_STEP_S
    generate_s = (load.first_chunk_tokens + 1) * step_s
    limit = stream_limit(load)
    position = load.num_active + extra_requests - limit  # >= 0: waits for a running stream to end
    if position < 0:
        return generate_s
    wait_per_slot_s = (load.avg_stream_s or load.first_chunk_tokens * 10 * step_s) / max(1, limit)
    return generate_s + (position + 1) * wait_per_slot_s


def decide(load: ReplicaLoad, deadline_s: float) -> Admission:
    """Admit under the stream limit; queue while the queue has room and the deadline can be met."""
    limit = stream_limit(load)
    if load.num_active < limit:
        return Admission.ADMIT
    if load.num_active - limit >= load.max_queued:
        return Admission.REJECT
    return Admission.QUEUE if predict_ttfa_s(load) <= deadline_s else Admission.REJECT

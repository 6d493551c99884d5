"""Admission and TTFA prediction (pure functions over replica stats).

The LLMStage replica decides admit / queue / reject with `decide`; the request router ranks
replicas with `predict_ttfa_s`. Both read the same `ReplicaLoad` the replica publishes.
"""

from __future__ import annotations

import enum
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

    def to_stats(self) -> dict:
        return asdict(self)

    @classmethod
    def from_stats(cls, stats: dict) -> ReplicaLoad | None:
        try:
            return cls(**{k: stats[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError):
            return None


def predict_ttfa_s(load: ReplicaLoad, extra_requests: int = 0) -> float:
    """Predicted time to first audio for one more request on this replica."""
    step_s = load.step_s or DEFAULT_STEP_S
    generate_s = (load.first_chunk_tokens + 1) * step_s
    position = load.num_active + extra_requests - load.max_streams  # >= 0: waits for a slot
    if position < 0:
        return generate_s
    wait_per_slot_s = (load.avg_stream_s or load.first_chunk_tokens * 10 * step_s) / max(1, load.max_streams)
    return generate_s + (position + 1) * wait_per_slot_s


def decide(load: ReplicaLoad, deadline_s: float) -> Admission:
    """Admit while a slot is free; queue while the queue has room and the deadline can be met."""
    if load.num_active < load.max_streams:
        return Admission.ADMIT
    if load.num_active - load.max_streams >= load.max_queued:
        return Admission.REJECT
    return Admission.QUEUE if predict_ttfa_s(load) <= deadline_s else Admission.REJECT

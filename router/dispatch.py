"""Data-parallel dispatch: a Serve RequestRouter that sends each request to the LLM replica
with the lowest predicted TTFA.

Replicas publish a `ReplicaLoad` through `record_routing_stats`; between two stats refreshes
this router counts the requests it has routed itself so a burst does not pile onto one replica.
"""

from __future__ import annotations

from collections import defaultdict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.admission import ReplicaLoad, predict_ttfa_s


class PredictedTTFARouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._routed_since_stats: dict[ReplicaID, int] = defaultdict(int)
        self._last_stats: dict[ReplicaID, dict] = {}

    def _ensure_state(self) -> None:
        if not hasattr(self, "_routed_since_stats"):
            self.initialize_state()

    def _score(self, replica: RunningReplica) -> tuple[float, int]:
        stats = replica.routing_stats or {}
        if stats != self._last_stats.get(replica.replica_id):
            self._last_stats[replica.replica_id] = stats
            self._routed_since_stats[replica.replica_id] = 0
        extra = self._routed_since_stats[replica.replica_id]
        load = ReplicaLoad.from_stats(stats)
        if load is None:  # no stats yet: spread by what we routed
            return (float(extra), extra)
        return (predict_ttfa_s(load, extra), load.num_active + extra)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        self._ensure_state()
        ranked = sorted(candidate_replicas, key=self._score)
        return [[replica] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._ensure_state()
        self._routed_since_stats[replica_id] += 1

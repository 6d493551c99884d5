"""Engine-stage Prometheus series (LLM and detok replicas), through Ray Serve's metrics API.

Each deployment creates the series it owns inside its replica; Serve adds the deployment,
replica and application tags. The router's series are in `router.metrics`; the Grafana
dashboard in k8s/monitoring plots both.
"""

from __future__ import annotations

from ray.serve.metrics import Gauge, Histogram

BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]


class StageMetrics:
    """Load of one engine stage (LLM or detok)."""

    def __init__(self, with_kv: bool) -> None:
        self.queue_depth = Gauge("voxray_queue_depth", "Requests (LLM) or chunks (detok) waiting for the engine.")
        self.active = Gauge("voxray_active_streams", "Streams this replica is serving.")
        self.batch_size = Histogram("voxray_batch_size", "Rows (LLM) or chunks (detok) per engine step.", BATCH_BUCKETS)
        self.kv_used = Gauge("voxray_kv_slots_used", "KV-cache slots in use.") if with_kv else None

"""After the cluster tests ran traffic, the Prometheus endpoint carries every VoxRay series."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.deployments.conftest import METRICS_PORT
from tests.deployments.grpc_helpers import run_stream

pytestmark = pytest.mark.slow

SERIES = [
    "ray_voxray_ttfa_seconds_count",
    "ray_voxray_stream_viable_total",
    "ray_voxray_streams_finished_total",
    "ray_voxray_chunk_underrun_seconds_count",
    "ray_voxray_audio_seconds_total",
    "ray_voxray_realtime_factor",
    "ray_voxray_queue_depth",
    "ray_voxray_active_streams",
    "ray_voxray_batch_size_count",
    "ray_voxray_kv_slots_used",
    "ray_voxray_admission_rejections_total",
]


def scrape() -> dict[str, float]:
    """Sum of every sample per series name (over tags)."""
    text = requests.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(ray_voxray_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match:
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
    return totals


def test_metrics_endpoint_has_every_series_with_sensible_values(cluster):
    ep = cluster["tight"]
    for i in range(2):
        assert run_stream(ep.grpc_target, ep.app_name, f"metrics {i}", sampling={"max_tokens": 42}).code.name == "OK"
    with ThreadPoolExecutor(6) as pool:  # more than the 3 the tight app admits: some rejections
        codes = {o.code.name for o in pool.map(lambda i: run_stream(ep.grpc_target, ep.app_name, "burst"), range(6))}
    assert "RESOURCE_EXHAUSTED" in codes
    deadline = time.monotonic() + 60
    totals = scrape()
    while any(name not in totals for name in SERIES) and time.monotonic() < deadline:
        time.sleep(2)
        totals = scrape()
    assert [name for name in SERIES if name not in totals] == []
    assert totals["ray_voxray_ttfa_seconds_count"] >= 2
    assert totals["ray_voxray_streams_finished_total"] >= totals["ray_voxray_stream_viable_total"] >= 0
    assert totals["ray_voxray_audio_seconds_total"] >= 2 * 6 * 2048 / 24000 * 0.99
    assert totals["ray_voxray_batch_size_count"] > 0
    assert 0 < totals["ray_voxray_realtime_factor"] < 1000
    assert totals["ray_voxray_kv_slots_used"] >= 0

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


def stage_gauges(app: str, replica: str = "") -> dict[str, float]:
    """`<series>:<deployment>` -> the gauge summed over `app`'s replicas (or only `replica`'s, a unique id)."""
    text = requests.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    gauges: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^ray_voxray_(active_streams|kv_slots_used|queue_depth)\{([^}]*)\} ([0-9.eE+-]+)$", line)
        if match is None:
            continue
        tags = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if tags.get("application") != app or (replica and tags.get("replica", "").rsplit("#", 1)[-1] != replica):
            continue
        key = f"{match.group(1)}:{tags.get('deployment', '')}"
        gauges[key] = gauges.get(key, 0.0) + float(match.group(3))
    return gauges


def wait_for_gauges(app: str, settled, timeout_s: float = 40.0, replica: str = "") -> dict[str, float]:
    """Scrape until `settled(gauges)` holds; the last scrape either way (the caller asserts on it)."""
    give_up_s = time.monotonic() + timeout_s
    gauges = stage_gauges(app, replica)
    while not settled(gauges) and time.monotonic() < give_up_s:
        time.sleep(0.5)
        gauges = stage_gauges(app, replica)
    return gauges


def is_busy(gauges: dict[str, float]) -> bool:
    return gauges.get("active_streams:LLMStage", 0) >= 1 and gauges.get("kv_slots_used:LLMStage", 0) >= 1


def is_idle(gauges: dict[str, float]) -> bool:
    """Every stage gauge of the app published and at zero."""
    names = ["active_streams:LLMStage", "kv_slots_used:LLMStage", "queue_depth:LLMStage",
             "active_streams:DetokStage", "queue_depth:DetokStage"]  # fmt: skip
    return all(name in gauges for name in names) and not any(gauges[name] for name in names)


def test_stage_gauges_return_to_zero_when_streams_end_or_are_cancelled(cluster):
    """The scraped gauges of both stages read zero once the app's streams are over: a stream that
    ended (the last engine step's reading stayed up while the replica sat idle) and one whose client
    cancelled it mid-stream. Each is first seen busy in the scrape, so zero is not just "never set"."""
    import grpc

    from cluster.client import make_request
    from protos import voxray_pb2_grpc

    ep = cluster["tight"]
    assert is_idle(wait_for_gauges(ep.app_name, is_idle)), "not idle before the test"
    for ending in ("end", "cancel"):
        with grpc.insecure_channel(ep.grpc_target) as channel:
            request = make_request(f"gauges {ending}", sampling={"max_tokens": 7 * 280})
            call = voxray_pb2_grpc.SpeechStub(channel).Synthesize(request, metadata=(("application", ep.app_name),))
            next(call)
            busy = wait_for_gauges(ep.app_name, is_busy)
            assert is_busy(busy), (ending, busy)
            if ending == "cancel":
                call.cancel()
            else:
                assert list(call)[-1].final
        idle = wait_for_gauges(ep.app_name, is_idle)
        assert is_idle(idle), (ending, idle)

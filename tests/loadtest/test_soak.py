"""loadtest/soak.py: the verdict on synthetic series (flat, growing, noisy, processes coming and going,
gauges left up), process naming, and one short real soak (a `voxray serve` sampled every 5 s)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest

from loadtest.cluster_process import process_role
from loadtest.soak_verdict import Sample, gauge_series, growths, level, process_changes, verdict
from tests.loadtest.tool_process import run_tool

_OFFSET = int(os.environ.get("VOXRAY_TEST_PORT_OFFSET", "0"))  # see tests/deployments/conftest.py
GRPC_PORT, HTTP_PORT = 19430 + _OFFSET, 19431 + _OFFSET
IDLE = {"gauge/ray_voxray_active_streams": 0.0, "gauge/ray_voxray_kv_slots_used": 0.0,
        "gauge/ray_voxray_queue_depth": 0.0}  # fmt: skip


def series(rss_mb, fds=None, extra=None, sample_s: float = 30.0, load_end_s: float = 600.0) -> list[Sample]:
    """One sample per value of `rss_mb` for process `p [1]`, then idle (gauges at zero) after `load_end_s`."""
    out = []
    for i, rss in enumerate(rss_mb):
        t_s = i * sample_s
        values = {"rss_mb/p [1]": rss, "fds/p [1]": fds[i] if fds else 40.0, **IDLE, **((extra or {}).get(i, {}))}
        out.append(Sample(t_s, "load" if t_s < load_end_s else "idle", values))
    return out


def test_flat_and_noisy_series_pass_and_report_their_worst():
    noisy = [500 + (7 if i % 2 else -7) for i in range(25)]  # +-1.4% around 500 MB
    result = verdict(series(noisy), warm_up_s=120, load_end_s=600, window_s=90)
    assert result["ok"] and result["flat"] and result["gauges_zero_when_idle"] and not result["grown"]
    assert result["worst"]["series"] in ("rss_mb/p [1]", "fds/p [1]") and result["series_checked"] == 2


def test_growth_past_five_percent_fails_naming_the_series():
    leaking = [400 + 4 * i for i in range(25)]  # +4 MB a sample
    result = verdict(series(leaking), warm_up_s=120, load_end_s=600, window_s=90)
    assert not result["ok"] and not result["flat"]
    [grown] = result["grown"]
    assert grown["series"] == "rss_mb/p [1]" and grown["at_warm_up"] == 420 and grown["at_end"] == 472
    assert grown["growth_pct"] == pytest.approx(12.38, abs=0.01) and result["worst"] == grown


def test_absolute_floors_keep_small_series_from_failing_on_noise():
    fds = [10.0] * 12 + [12.0] * 13  # +20%, but 2 fds: under the floor of 3
    assert verdict(series([300] * 25, fds=fds), 120, 600, 90)["flat"]
    fds = [10.0] * 12 + [14.0] * 13
    assert [g.series for g in growths(series([300] * 25, fds=fds), 120, 600, 90) if not g.ok] == ["fds/p [1]"]


def test_levels_are_medians_over_the_window():
    samples = series([100, 100, 900, 100, 100])  # one spike does not move the median
    assert level(samples, "rss_mb/p [1]", 0, 150) == 100 and level(samples, "missing", 0, 150) is None


def test_processes_that_come_or_go_after_warm_up_fail():
    extra = {i: {"rss_mb/ray::IDLE [9]": 60.0} for i in range(10, 25)}  # a worker started at 300 s, kept
    result = verdict(series([300] * 25, extra=extra), 120, 600, 90)
    assert result["processes"] == {"appeared": ["ray::IDLE [9]"], "gone": []} and not result["flat"]
    gone = process_changes(series([300] * 25, extra={i: {"rss_mb/q [2]": 1.0} for i in range(8)}), 120)
    assert gone == {"appeared": [], "gone": ["q [2]"]}


def test_gauges_left_up_after_the_idle_tail_fail():
    stale = {24: {"gauge/ray_voxray_kv_slots_used": 1.0}}
    result = verdict(series([300] * 25, extra=stale), 120, 600, 90)
    assert result["flat"] and not result["gauges_zero_when_idle"] and not result["ok"]
    assert result["idle_gauges"]["gauge/ray_voxray_kv_slots_used"] == 1.0


def test_gauges_dropped_from_the_endpoint_keep_their_last_value():
    dropped = series([300] * 25)
    dropped[-3:] = [Sample(s.t_s, s.phase, {k: v for k, v in s.values.items() if not k.startswith("gauge/")})
                    for s in dropped[-3:]]  # fmt: skip
    result = verdict(dropped, 120, 600, 90)
    assert result["gauges_zero_when_idle"] and result["gauges_scraped_at_end"] == []
    stale = dropped[:-4] + [
        Sample(dropped[-4].t_s, "idle", {**dropped[-4].values, "gauge/ray_voxray_kv_slots_used": 1.0})
    ]
    assert verdict(stale + dropped[-3:], 120, 600, 90)["idle_gauges"]["gauge/ray_voxray_kv_slots_used"] == 1.0


def test_gauge_series_keeps_gauges_and_the_object_store_only():
    scraped = {"ray_voxray_active_streams": 2.0, "ray_voxray_ttfa_seconds_count": 9.0,
               "ray_voxray_streams_finished_total": 9.0, "ray_object_store_used_memory": 3 * 2**20,
               "ray_object_store_num_local_objects": 4.0}  # fmt: skip
    assert gauge_series(scraped) == {"gauge/ray_voxray_active_streams": 2.0, "object_store_mb": 3.0,
                                     "object_store_objects": 4.0}  # fmt: skip


@dataclass
class FakeProcess:
    pid: int
    argv: list[str]

    def cmdline(self) -> list[str]:
        return self.argv

    def name(self) -> str:
        return self.argv[0].rsplit("/", 1)[-1]


def test_processes_are_named_by_ray_title_script_or_binary():
    assert process_role(FakeProcess(1, ["python", "-m", "cluster.cli", "serve"]), root_pid=1) == "voxray serve"
    title = FakeProcess(2, ["ray::ServeController.listen_for_change"])  # Ray's title names the running method
    assert process_role(title, 1) == "ray::ServeController"
    assert process_role(FakeProcess(3, ["ray::ServeReplica:voxray:LLMStage"]), 1) == "ray::ServeReplica:voxray:LLMStage"
    assert process_role(FakeProcess(4, ["/v/bin/python", "-u", "/v/ray/_private/log_monitor.py", "--x"]), 1) == (
        "log_monitor.py"
    )
    assert process_role(FakeProcess(5, ["/v/ray/core/src/ray/raylet/raylet", "--a=b"]), 1) == "raylet"


@pytest.mark.slow
@pytest.mark.own_server
@pytest.mark.timeout(300)
def test_short_soak_samples_every_process_and_writes_its_report(tmp_path):
    """One replica of each stage (the 2-replica soak is `make soak`'s): the sampling and report are the same."""
    out = tmp_path / "soak.json"
    printed = run_tool("loadtest.soak", "--duration-s", "20", "--sample-s", "5", "--warm-up-s", "5",
                       "--idle-tail-s", "10", "--replicas", "1", "--grpc-port", str(GRPC_PORT),
                       "--http-port", str(HTTP_PORT), "--out", str(out), timeout_s=280)  # fmt: skip
    report = json.loads(out.read_text())
    samples = report["samples"]
    assert len(samples) >= 6 and "verdict: " + ("OK" if report["verdict"]["ok"] else "FAIL") in printed
    assert out.with_suffix(".png").stat().st_size > 0
    roles = [name.split("/", 1)[1].rsplit(" [", 1)[0] for name in samples[-1]["values"] if name.startswith("rss_mb/")]
    for role in ("voxray serve", "gcs_server", "raylet", "ray::ServeController", "ray::ProxyActor",
                 "ray::ServeReplica:voxray:Router"):  # fmt: skip
        assert role in roles, roles
    assert roles.count("ray::ServeReplica:voxray:LLMStage") == roles.count("ray::ServeReplica:voxray:DetokStage") == 1
    assert any("object_store_mb" in s["values"] and "gauge/ray_voxray_active_streams" in s["values"] for s in samples)
    assert report["streams"]["finished"] > 0 and report["verdict"]["series_checked"] > 20

"""loadtest/chaos_bench.py: its schedule, stream outcomes and audio comparison on hand-built records,
and the bounded chaos run (a real `voxray serve` with 2 LLM + 2 detok replicas, 60 s of Poisson load,
an LLM kill, a drain, a detok kill, each fault after Serve's replacement of the one before): every
admitted stream finishes, greedy / seeded audio equals an undisturbed in-process run, every fault
happened."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from loadtest import chaos_bench
from loadtest.chaos_bench import (
    Fault,
    FaultRecord,
    busiest_replica,
    fault_schedule,
    next_chunk_max_s,
    run_faults,
    summarize,
    target_streams,
)
from loadtest.chaos_streams import StreamResult, StreamSpec, compare_audio, plan_streams
from tests.loadtest.tool_process import run_tool

_OFFSET = int(os.environ.get("VOXRAY_TEST_PORT_OFFSET", "0"))  # see tests/deployments/conftest.py
GRPC_PORT, HTTP_PORT = 19420 + _OFFSET, 19421 + _OFFSET


def test_kills_alternate_and_the_drain_falls_between_two_kills():
    assert fault_schedule(120, 45) == [Fault(45, "kill", "LLMStage"), Fault(67.5, "drain", "LLMStage"),
                                       Fault(90, "kill", "DetokStage")]  # fmt: skip
    faults = fault_schedule(600, 60)
    kills = [f for f in faults if f.action == "kill"]
    assert [f.at_s for f in kills] == [60 * k for k in range(1, 10)]
    assert [f.deployment for f in kills[:3]] == ["LLMStage", "DetokStage", "LLMStage"]
    assert [f.at_s for f in faults if f.action == "drain"] == [330]
    assert [f.action for f in fault_schedule(120, 45, drain=False)] == ["kill", "kill"]


def test_each_fault_gets_a_long_greedy_or_seeded_stream_started_just_before_it():
    targets = target_streams(fault_schedule(120, 45), seed=0)
    assert [(t.kind, t.scheduled_s) for t in targets] == [("greedy", 44.0), ("seeded", 66.5), ("greedy", 89.0)]
    assert all(t.sampling["max_tokens"] == 7 * 96 for t in targets) and len({t.req_id for t in targets}) == 3


def test_a_fault_delayed_by_the_last_ones_recovery_starts_its_target_stream_when_it_fires(monkeypatch):
    """The target stream is started by the fault thread just before its fault, not at the planned time:
    a fault late behind the previous fault's recovery still finds its target playing."""
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(chaos_bench, "HIT_LEAD_S", 0.01)

    def fake_inject(fault, record, app_name, results, t0, wait_s):
        events.append(("fault", fault.deployment))
        time.sleep(0.3 if fault.deployment == "LLMStage" else 0.0)  # the first fault's recovery runs long
        events.append(("recovered", fault.deployment))

    class FakeLauncher:
        t0, server = time.monotonic(), SimpleNamespace(config=SimpleNamespace(app_name="voxray"))

        def launch(self, result):
            events.append(("target", result.spec.req_id))

    monkeypatch.setattr(chaos_bench, "inject", fake_inject)
    faults = [Fault(0.02, "kill", "LLMStage"), Fault(0.05, "kill", "DetokStage")]
    targets = [StreamResult(spec) for spec in target_streams(faults, seed=0)]
    records: list[FaultRecord] = []
    run_faults(faults, targets, records, FakeLauncher(), [], wait_s=0.0)
    assert events == [("target", "chaos-target-0"), ("fault", "LLMStage"), ("recovered", "LLMStage"),
                      ("target", "chaos-target-1"), ("fault", "DetokStage"), ("recovered", "DetokStage")]  # fmt: skip
    run_faults(faults, [None, None], records, FakeLauncher(), [], wait_s=0.0)  # --no-target-streams
    assert [kind for kind, _ in events[6:]] == ["fault", "recovered", "fault", "recovered"] and len(records) == 4


def test_the_plan_mixes_greedy_seeded_and_incremental_streams_reproducibly():
    specs = plan_streams(1.0, 200, 0.2, seed=3)
    assert specs == plan_streams(1.0, 200, 0.2, seed=3) and 150 < len(specs) < 260
    kinds = [s.kind for s in specs]
    assert {kinds.count(k) / len(kinds) > 0.1 for k in ("greedy", "seeded", "incremental")} == {True}
    assert all(s.sampling["temperature"] == 0.0 for s in specs if s.kind == "greedy")
    assert len({s.sampling["seed"] for s in specs if s.kind != "greedy"}) == sum(k != "greedy" for k in kinds)


def _result(req_id: str, kind: str = "seeded", code: str = "OK", chunks=(), details: str = "", ended_s=10.0):
    spec = StreamSpec(req_id, kind, "text", {"seed": 1, "max_tokens": 7 * 48}, 0.0)
    result = StreamResult(spec, sent_s=1.0, ended_s=ended_s, code=code, details=details)
    for t_s, replica in chunks:
        result.on_chunk(0.5, b"\0\0" * 4, f"LLMStage#{replica}", "DetokStage#d1", t_s)
    return result


def test_refused_failed_and_finished_streams_are_told_apart():
    finished = _result("a", chunks=[(1.3, "x"), (1.5, "x")])
    refused = _result("b", code="RESOURCE_EXHAUSTED", details="cluster full for b: predicted TTFA 39.5 s")
    failed = _result("c", code="UNAVAILABLE", chunks=[(1.4, "x")])  # after audio: admitted, then lost
    late = _result("d", chunks=[(1.2, "y"), (3.0, "y")])  # second chunk 1.3 s after 0.5 s of audio
    assert (finished.is_finished, finished.is_viable, late.is_viable) == (True, True, False)
    assert refused.is_refused and not failed.is_refused and not failed.is_finished
    assert refused.refusal_reason() == "RESOURCE_EXHAUSTED: cluster full for <id>: predicted TTFA # s"
    summary = summarize([finished, refused, failed, late], [Fault(1, "kill", "LLMStage")], [])
    assert summary["refused_in_failover"] == 0  # no kill done
    kill = FaultRecord(Fault(1, "kill", "LLMStage"), done_at_s=0.5, replica="x")
    assert summarize([refused], [kill.fault], [kill])["refusals_in_failover"] == {refused.refusal_reason(): 1}
    assert (summary["sent"], summary["refused"], summary["admitted"], summary["finished"]) == (4, 1, 3, 2)
    assert summary["failed"] == [{"req_id": "c", "code": "UNAVAILABLE", "details": ""}]
    assert summary["pct_viable"] == 50.0 and summary["faults_planned"] == 1 and summary["faults_done"] == 0


def test_audio_equal_within_two_steps_of_pcm16():
    result = _result("a")
    result.audio = np.array([100, -200, 300], dtype="<i2").tobytes()
    compare_audio(result, np.array([102, -199, 300], dtype="<i2").tobytes())
    assert (result.same_audio, result.max_pcm_diff) == (True, 2)
    compare_audio(result, np.array([103, -200, 300], dtype="<i2").tobytes())
    assert (result.same_audio, result.max_pcm_diff) == (False, 3)
    compare_audio(result, np.array([100, -200], dtype="<i2").tobytes())  # a different length: other tokens
    assert result.same_audio is False


def test_the_victim_is_the_replica_most_playing_streams_use_and_waits_are_measured_from_the_fault():
    playing = [_result("a", chunks=[(2.0, "x")], ended_s=0.0), _result("b", chunks=[(2.0, "y"), (5.5, "y")]),
               _result("c", chunks=[(2.5, "y")], ended_s=0.0), _result("d", chunks=[(2.0, "x")]),
               _result("e", chunks=[(2.6, "y")], ended_s=0.0)]  # fmt: skip
    assert busiest_replica(playing, "LLMStage", ["x", "y"]) == "y"  # playing: a on x, c and e on y
    assert busiest_replica([], "LLMStage", ["x", "y"]) == "x"
    assert next_chunk_max_s(playing, 4.0, ["a", "b"]) == 1.5  # b's next chunk came 1.5 s after a fault at 4 s
    assert next_chunk_max_s(playing, 4.0, ["a"]) is None  # a got none after it


@pytest.mark.slow  # (not own_server: beside the session cluster's tests, Serve's replacements ran late and
@pytest.mark.timeout(480)  # the last fault found no stream to hit; on the cluster run it has the box to itself)
def test_bounded_chaos_run(tmp_path):
    out = tmp_path / "chaos.json"  # its own process: this one may be a driver of another test's Ray
    run_tool("loadtest.chaos_bench", "--duration-s", "45", "--kill-every-s", "15", "--grpc-port", str(GRPC_PORT),
             "--http-port", str(HTTP_PORT), "--out", str(out), timeout_s=450)  # fmt: skip
    report = json.loads(out.read_text())
    summary, faults = report["summary"], report["faults"]
    assert [(f["action"], f["deployment"]) for f in faults] == [("kill", "LLMStage"), ("drain", "LLMStage"),
                                                                ("kill", "DetokStage")]  # fmt: skip
    assert all(f["done_at_s"] is not None and f["replica"] and not f["error"] for f in faults), faults
    assert all(f["hit_streams"] for f in faults), faults  # the replica killed served a stream then
    assert summary["admitted"] >= 10 and summary["finished"] == summary["admitted"], summary["failed"]
    mismatched = [s["req_id"] for s in report["streams"] if s["same_audio"] is False]
    assert summary["compared"] >= 5 and summary["same_audio"] == summary["compared"], mismatched


def test_joining_a_server_refuses_while_this_process_drives_another_ray(monkeypatch):
    """A bench in a process that is already a driver of another Ray (a test session's) would kill and
    query that cluster's replicas: joining the server's raises instead."""
    import ray

    from loadtest import cluster_process

    monkeypatch.setattr(cluster_process, "gcs_address", lambda pid: "127.0.0.1:6380")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:6379"))
    with pytest.raises(RuntimeError, match="already a driver of the Ray at 127.0.0.1:6379"):
        cluster_process.join_cluster(SimpleNamespace(proc=SimpleNamespace(pid=1)))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:6380"))
    cluster_process.join_cluster(SimpleNamespace(proc=SimpleNamespace(pid=1)))  # the server's own: nothing to do

"""Streams that outlive a lost replica: a detok or an LLM replica is killed (`ray.kill`, a real
replica) while four streams play; every stream finishes without an error and its audio equals
an uninterrupted in-process run (SNAC decodes self-describing chunks deterministically; a stream
resumed on the other LLM replica continues with the same greedy / seeded tokens)."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import ray
from ray import serve

from core.config import AdmissionConfig, MigrationConfig, StageDeploymentConfig
from tests.deployments.conftest import deployment_actor_names, small_config
from tests.deployments.grpc_helpers import StreamOutcome, run_stream
from tests.deployments.test_cluster import in_process_audio
from tests.deployments.test_metrics import wait_for_gauges

pytestmark = pytest.mark.slow

FAILOVER = small_config(
    app_name="voxray-fo", route_prefix="/fo", llm=StageDeploymentConfig(num_cpus=0.25),
    detok=StageDeploymentConfig(num_replicas=2, num_cpus=0.25),  # the session cluster's 4 CPUs hold all three apps
    admission=AdmissionConfig(max_streams_per_replica=4, max_queued_per_replica=4, default_ttfa_deadline_s=60.0),
)  # fmt: skip


def _replicas(app_name: str, deployment: str) -> list:
    return [
        ray.get_actor(actor["name"], namespace=actor["namespace"])
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(f"SERVE_REPLICA::{app_name}#{deployment}#")
    ]


def _replica_actor(app_name: str, tag: str):
    """The actor of replica `tag` (`Deployment#<id>`) of `app_name`."""
    [actor] = [
        ray.get_actor(actor["name"], namespace=actor["namespace"])
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"] == f"SERVE_REPLICA::{app_name}#{tag}"
    ]
    return actor


def _replica_stats(app_name: str, replica_id: str) -> dict:
    """`LLMStage.stats()` of one replica, asked of its actor (a handle would pick the replica)."""

    def stats(actor) -> dict:  # runs in the replica actor (Ray's `__ray_call__`, for tests and debugging)
        return actor._replica_impl._user_callable_wrapper.user_callable.stats()

    return ray.get(_replica_actor(app_name, f"LLMStage#{replica_id}").__ray_call__.remote(stats))


def _pace_forward(app_name: str, llm_replica: str, min_step_s: float) -> None:
    """Make every forward of replica `llm_replica` (`LLMStage#<id>`) last at least `min_step_s`: a stream
    started after lasts a known time on any box (a fault then finds it playing) with few tokens, and the
    replica sleeps out the rest of each step (the CPU stays with the other tests)."""

    def pace(actor, min_step_s: float) -> None:  # runs in the replica actor
        import time

        runner = actor._replica_impl._user_callable_wrapper.user_callable.side.engine.runner
        forward = runner.forward

        def paced_forward(step):
            start_s = time.monotonic()
            out = forward(step)
            time.sleep(max(0.0, min_step_s - (time.monotonic() - start_s)))
            return out

        runner.forward = paced_forward

    ray.get(_replica_actor(app_name, llm_replica).__ray_call__.remote(pace, min_step_s), timeout=30)


def _kv_courier(app_name: str):
    """The LLM stage's KV courier (a Serve deployment actor)."""
    from ray.serve._private.constants import SERVE_NAMESPACE

    [name] = deployment_actor_names(app_name, "LLMStage", "kv_courier")
    return ray.get_actor(name, namespace=SERVE_NAMESPACE)


def _detok_replicas(app_name: str) -> list:
    return _replicas(app_name, "DetokStage")


def _play_all(ep, jobs: list[dict]) -> tuple[dict, list[threading.Thread]]:
    """Start every job; the outcomes fill in as chunks arrive."""
    outcomes = {job["request_id"]: StreamOutcome() for job in jobs}

    def play(job: dict) -> None:
        run_stream(ep.grpc_target, ep.app_name, outcome=outcomes[job["request_id"]], **job)

    threads = [threading.Thread(target=play, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    return outcomes, threads


def _wait_until_all_play(outcomes: dict, min_chunks: int = 2, timeout_s: float = 60.0) -> None:
    """Until every stream has sent `min_chunks` chunks (and none has ended): a loss then hits them all."""
    give_up_s = time.monotonic() + timeout_s
    while not all(len(o.chunks) >= min_chunks for o in outcomes.values()):
        assert time.monotonic() < give_up_s, "the streams did not start"
        time.sleep(0.02)
    assert not any(o.chunks[-1].final for o in outcomes.values()), "a stream ended before the loss: make it longer"


def _detok_replica_once_both_decode(outcomes: dict, timeout_s: float = 60.0) -> str:
    """`DetokStage#<id>` of one detok replica, once both have decoded chunks of the playing streams."""
    give_up_s = time.monotonic() + timeout_s
    while time.monotonic() < give_up_s:
        decoded_by = sorted({c.detok_replica for o in list(outcomes.values()) for c in list(o.chunks)})
        if len(decoded_by) == 2:
            return decoded_by[0]
        time.sleep(0.05)
    raise AssertionError("the streams' chunks did not reach both detok replicas")


def _replica_of_a_playing_stream(outcomes: dict, timeout_s: float = 60.0) -> str:
    """`LLMStage#<id>` of the replica serving the first stream to send audio (once it has 3 chunks)."""
    give_up_s = time.monotonic() + timeout_s
    while time.monotonic() < give_up_s:
        for outcome in outcomes.values():
            if len(outcome.chunks) >= 3:
                return outcome.chunks[0].llm_replica
        time.sleep(0.05)
    raise AssertionError("no stream played")


def _check_audio(outcomes: dict, jobs: list[dict], engine) -> None:
    expected = in_process_audio(jobs, engine)
    for job in jobs:
        outcome = outcomes[job["request_id"]]
        assert outcome.code == grpc.StatusCode.OK, outcome.details
        got = np.frombuffer(outcome.pcm16, dtype="<i2").astype(np.int32)
        want = np.frombuffer(expected[job["request_id"]], dtype="<i2").astype(np.int32)
        differs = np.flatnonzero(np.abs(got - want) > 2) if got.shape == want.shape else np.array([0])
        chunks = [(c.seq, c.llm_replica[-4:], round(c.duration_s, 3)) for c in outcome.chunks]
        assert got.shape == want.shape and not differs.size, (job["request_id"], differs[:3], chunks)


def test_streams_survive_losing_a_detok_replica(cluster):
    from cluster.server import deploy_app

    ep = deploy_app(FAILOVER)
    try:
        jobs = [{"request_id": f"fo-{i}", "text": f"failover {i}", "voice": "tara",
                 "sampling": {"seed": i, "max_tokens": 7 * 48}} for i in range(4)]  # fmt: skip
        outcomes, threads = _play_all(ep, jobs)
        victim = _detok_replica_once_both_decode(outcomes)
        assert len(_detok_replicas(ep.app_name)) == 2
        killed_at = time.monotonic()
        ray.kill(_replica_actor(ep.app_name, victim), no_restart=True)
        for thread in threads:
            thread.join(timeout=120)
        _check_audio(outcomes, jobs, FAILOVER.engine)
        after_kill = run_stream(ep.grpc_target, ep.app_name, "after the kill", sampling={"max_tokens": 28})
        assert after_kill.code == grpc.StatusCode.OK and after_kill.chunks[-1].final  # new requests still served
        decoded_by = {c.detok_replica for o in outcomes.values() for c in o.chunks}
        assert len(decoded_by) == 2  # both replicas served chunks: the killed one had taken part
        # Whether a decode call was in flight at the kill (then `detok_retries` counts its resend)
        # depends on timing; the streams' completion and audio above must hold either way.
        stats = serve.get_deployment_handle("LLMStage", ep.app_name).stats.remote().result()
        next_chunk_s = max(min(t for t in o.arrivals_s if t > killed_at) - killed_at for o in outcomes.values())
        print(
            f"decode calls resent: {stats['detok_retries']}; kill -> next chunk of every stream <= {next_chunk_s:.3f} s"
        )
    finally:
        serve.delete(ep.app_name)


LONE_LLM = small_config(
    app_name="voxray-lone", route_prefix="/lone", llm=StageDeploymentConfig(num_cpus=0.25),
    detok=StageDeploymentConfig(num_cpus=0.25), migration=MigrationConfig(replacement_wait_s=90.0),  # a loaded box
    admission=AdmissionConfig(max_streams_per_replica=4, max_queued_per_replica=4, default_ttfa_deadline_s=60.0),
)  # fmt: skip


def _unavailable_while_no_replica(ep, timeout_s: float = 10.0):
    """A new request's outcome once one answers UNAVAILABLE (Serve has dropped the dead replica), or the
    last one's when none did within `timeout_s`."""
    give_up_s = time.monotonic() + timeout_s
    while True:
        outcome = run_stream(ep.grpc_target, ep.app_name, "anyone there?", sampling={"max_tokens": 28})
        if outcome.code == grpc.StatusCode.UNAVAILABLE or time.monotonic() > give_up_s:
            return outcome
        time.sleep(0.1)


def test_streams_wait_for_the_replacement_of_the_only_llm_replica(cluster):
    """The one LLM replica dies under four streams: each waits for Serve's replacement and resumes
    there from its last checkpoint, late but complete, with the audio of an uninterrupted run; a new
    request meanwhile answers UNAVAILABLE with a retry hint at once (it has nothing to lose by retrying)."""
    from cluster.server import deploy_app

    ep = deploy_app(LONE_LLM)
    try:
        jobs = [{"request_id": f"lone-{i}", "text": f"alone {i}", "voice": "tara",
                 "sampling": {"seed": i, "max_tokens": 7 * 96} if i % 2 else {"temperature": 0.0, "max_tokens": 7 * 96}}
                for i in range(4)]  # fmt: skip
        outcomes, threads = _play_all(ep, jobs)
        _wait_until_all_play(outcomes)
        [replica] = _replicas(ep.app_name, "LLMStage")
        killed_at = time.monotonic()
        ray.kill(replica, no_restart=True)
        asked_at = time.monotonic()
        new = _unavailable_while_no_replica(ep)
        answered_s = time.monotonic() - asked_at
        assert new.code == grpc.StatusCode.UNAVAILABLE, (new.code, new.details)
        assert "retry after" in new.details and int(new.trailers["retry-after-ms"]) > 0
        for thread in threads:
            thread.join(timeout=180)
        _check_audio(outcomes, jobs, LONE_LLM.engine)
        for outcome in outcomes.values():  # each resumed on the replacement
            assert len({c.llm_replica for c in outcome.chunks}) == 2, [c.llm_replica for c in outcome.chunks]
        gaps = [max(np.diff(o.arrivals_s)) for o in outcomes.values()]
        print(f"kill -> a new request answered UNAVAILABLE in {answered_s:.2f} s; 4/4 streams finished, their "
              f"longest gap {max(gaps):.1f} s (the replacement's start); {time.monotonic() - killed_at:.1f} s in all")
    finally:
        serve.delete(ep.app_name)


LLM_MOVE = small_config(
    app_name="voxray-move", route_prefix="/move", llm=StageDeploymentConfig(num_replicas=2, num_cpus=0.25),
    detok=StageDeploymentConfig(num_cpus=0.25), migration=MigrationConfig(kv_transport="gloo"),  # the courier, one node
    admission=AdmissionConfig(max_streams_per_replica=4, max_queued_per_replica=4, default_ttfa_deadline_s=60.0),
)  # fmt: skip


def has_no_streams(gauges: dict[str, float]) -> bool:
    """An LLM replica's scraped gauges published and at zero."""
    names = ("active_streams:LLMStage", "kv_slots_used:LLMStage")
    return all(gauges.get(name) == 0 for name in names)


def test_streams_move_with_their_kv_off_a_leaving_llm_replica(cluster):
    """A replica asked to leave hands its streams to the other one between two engine steps, KV
    included (no prefill there); every stream finishes with the audio of an uninterrupted run."""
    from cluster.drain import live_llm_replicas, move_out
    from cluster.server import deploy_app
    from router.drain import llm_replicas_on_node

    ep = deploy_app(LLM_MOVE)
    try:
        jobs = [{"request_id": f"move-{i}", "text": f"moving {i}", "voice": "tara",
                 "sampling": {"seed": i, "max_tokens": 7 * 96} if i % 2 else {"temperature": 0.0, "max_tokens": 7 * 96}}
                for i in range(4)]  # fmt: skip
        outcomes, threads = _play_all(ep, jobs)
        leaving_id = _replica_of_a_playing_stream(outcomes).rsplit("#", 1)[-1]
        here = llm_replicas_on_node(ep.app_name, ray.get_runtime_context().get_node_id())
        assert set(here) == live_llm_replicas(ep.app_name)  # one node: both announced it (worker preStop)
        report = move_out(ep.app_name, [leaving_id], timeout_s=60)
        assert report.streams_left == 0  # every stream it held was handed off before the wait ended
        # the leaving replica's scraped gauges fall to zero with its last stream gone (no step follows there)
        left = wait_for_gauges(ep.app_name, has_no_streams, replica=leaving_id)
        assert has_no_streams(left), left
        for thread in threads:
            thread.join(timeout=120)
        _check_audio(outcomes, jobs, LLM_MOVE.engine)
        moved = [o for o in outcomes.values() if len({c.llm_replica for c in o.chunks}) == 2]
        assert moved and all(o.chunks[-1].llm_replica.endswith(leaving_id) is False for o in moved)
        kept = serve.get_deployment_handle("LLMStage", ep.app_name).stats.remote().result()  # the leaving
        assert not kept["replica"].endswith(leaving_id)  # replica reports itself full: routers pick the other
        # every stream handed over with its KV decoded on, no prefill: those moved out (before their
        # first chunk too) and any rebalanced before the move. A rebalance the Router asked of the kept
        # replica just as the move began lands back there (the other one is leaving): every parcel
        # either replica sent arrived, each with its rows.
        leaver = _replica_stats(ep.app_name, leaving_id)
        sent, arrived = leaver["kv_moved_out"] + kept["kv_moved_out"], leaver["kv_moved_in"] + kept["kv_moved_in"]
        assert arrived == sent and leaver["kv_moved_out"] >= len(moved), (kept, leaver)
        assert kept["kv_bytes_moved_in"] > 0, kept
        # the KV crossed over RDT-gloo (the courier's pair), as the sink endpoint counted it
        for stats in (kept, leaver):
            assert stats["kv_moved_in_over"] == {"gloo": stats["kv_moved_in"], "object_store": 0}, stats
        courier = _kv_courier(ep.app_name)
        delivered = ray.get(courier.stats.remote(), timeout=30)
        assert delivered["sinks"]["bytes_received"] >= kept["kv_bytes_moved_in"] and delivered["failed"] == 0
        assert delivered["sinks"]["held"] == delivered["sources"]["held"] == 0, delivered  # each parcel read
        print(f"{len(moved)} streams moved with {kept['kv_bytes_moved_in'] / 1e6:.2f} MB of KV "
              f"in {report.moved_s:.2f} s; courier {delivered}")  # fmt: skip
    finally:
        serve.delete(ep.app_name)

"""GPU faults on a real Serve app, injected on CPU into an LLM replica's engine (Ray's `__ray_call__`
patches its forward to raise once): an out-of-memory error at a new stream's prefill fails that
stream with RESOURCE_EXHAUSTED and a retry hint, while the stream already playing on the replica
finishes with the audio of an uninterrupted run and the replica serves the next request; a lost
device (a CUDA error in a step) ends its LLM replica, whose streams resume on the other one and
finish with the audio of an uninterrupted run."""

from __future__ import annotations

import time

import grpc
import pytest
import ray
from ray import serve
from ray.exceptions import RayActorError

from cluster.drain import live_llm_replicas
from core.config import AdmissionConfig, StageDeploymentConfig
from tests.deployments.conftest import replica_tags, small_config
from tests.deployments.grpc_helpers import retry_delay_s, run_stream
from tests.deployments.test_zz_failover import (
    _check_audio,
    _pace_forward,
    _play_all,
    _replica_actor,
    _replica_of_a_playing_stream,
    _replica_stats,
    _wait_until_all_play,
)

pytestmark = pytest.mark.slow

ADMIT_ALL = AdmissionConfig(max_streams_per_replica=4, max_queued_per_replica=4, default_ttfa_deadline_s=60.0)
OOM_APP = small_config(
    app_name="voxray-oom", route_prefix="/oom", llm=StageDeploymentConfig(num_cpus=0.25),
    detok=StageDeploymentConfig(num_cpus=0.25),
    # a fixed cap: the predictive policy on a slow box (or on the paced steps below) holds the second
    # stream in the queue until the first ends, and the failing prefill then runs alone
    admission=ADMIT_ALL.model_copy(update={"policy": "fixed_cap"}),
)  # fmt: skip
DEVICE_LOST_APP = small_config(
    app_name="voxray-devlost", route_prefix="/devlost", llm=StageDeploymentConfig(num_replicas=2, num_cpus=0.25),
    detok=StageDeploymentConfig(num_cpus=0.25), admission=ADMIT_ALL,
)  # fmt: skip


def _fail_next_forward(app_name: str, llm_replica: str, fault: str) -> None:
    """Make the next forward of replica `llm_replica` (`LLMStage#<id>`) with prompt rows in it
    ("oom") or the next one at all ("device") raise once, as a GPU would; the runner keeps the
    number of decode rows that failed forward had (`failed_decode_rows`)."""

    def arm(actor, fault: str) -> None:  # runs in the replica actor
        import torch

        runner = actor._replica_impl._user_callable_wrapper.user_callable.side.engine.runner
        forward = runner.forward

        def forward_or_fail(step):
            if fault == "oom" and step.prefill is None and step.folded_rows is None:
                return forward(step)
            runner.forward = forward  # once
            runner.failed_decode_rows = step.num_decodes
            if fault == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected)")

        runner.forward = forward_or_fail

    ray.get(_replica_actor(app_name, llm_replica).__ray_call__.remote(arm, fault), timeout=30)


def _failed_decode_rows(app_name: str, llm_replica: str) -> int:
    """The decode rows of the forward `_fail_next_forward` failed on `llm_replica`."""

    def read(actor) -> int:  # runs in the replica actor
        return actor._replica_impl._user_callable_wrapper.user_callable.side.engine.runner.failed_decode_rows

    return ray.get(_replica_actor(app_name, llm_replica).__ray_call__.remote(read), timeout=30)


def _has_ended(actor, timeout_s: float = 30.0) -> bool:
    """Whether `actor` dies within `timeout_s` (a call to it then fails with RayActorError)."""
    give_up_s = time.monotonic() + timeout_s
    while time.monotonic() < give_up_s:
        try:
            ray.get(actor.__ray_call__.remote(lambda actor: None), timeout=timeout_s)
        except RayActorError:
            return True
        time.sleep(0.05)
    return False


def _job(request_id: str, text: str, seed: int | None = None, num_frames: int = 72) -> dict:
    """A greedy (or seeded) stream of `num_frames` SNAC frames: long enough to play through a fault."""
    sampling = {"seed": seed} if seed is not None else {"temperature": 0.0}
    sampling["max_tokens"] = 7 * num_frames
    return {"request_id": request_id, "text": text, "voice": "tara", "sampling": sampling}


def test_an_out_of_memory_prefill_fails_only_its_stream_and_the_replica_serves_on(cluster):
    from cluster.server import deploy_app

    ep = deploy_app(OOM_APP)
    try:
        [replica_id] = live_llm_replicas(ep.app_name)
        llm_replica = f"LLMStage#{replica_id}"
        _pace_forward(ep.app_name, llm_replica, 0.01)  # 128 frames: >= 9 s of decoding
        playing = [_job("oom-playing", "the stream that plays on", num_frames=128)]
        outcomes, threads = _play_all(ep, playing)
        _wait_until_all_play(outcomes)
        assert outcomes["oom-playing"].chunks[0].llm_replica == llm_replica
        _fail_next_forward(ep.app_name, llm_replica, "oom")
        failed = run_stream(ep.grpc_target, ep.app_name, "the stream that asks too much", sampling={"max_tokens": 28})
        assert failed.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (failed.code, failed.details)
        assert "out of accelerator memory" in failed.details and not failed.chunks
        assert retry_delay_s(failed.trailers) == OOM_APP.admission.retry_after_s
        for thread in threads:
            thread.join(timeout=120)
        assert _failed_decode_rows(ep.app_name, llm_replica) == 1  # the playing stream was in the failed step
        _check_audio(outcomes, playing, OOM_APP.engine)
        after = [_job("oom-after", "the next request", seed=3, num_frames=24)]
        next_outcomes, next_threads = _play_all(ep, after)
        for thread in next_threads:
            thread.join(timeout=120)
        _check_audio(next_outcomes, after, OOM_APP.engine)
        assert {c.llm_replica for c in next_outcomes["oom-after"].chunks} == {llm_replica}
        stats = _replica_stats(ep.app_name, llm_replica.rsplit("#", 1)[-1])
        assert stats["out_of_memory"] == 1 and stats["kv_slots_used"] == 0 and stats["engine_requests"] == 0
    finally:
        serve.delete(ep.app_name)


def test_a_lost_device_ends_its_llm_replica_and_its_streams_resume_on_the_other(cluster):
    from cluster.server import deploy_app

    ep = deploy_app(DEVICE_LOST_APP)
    try:
        for tag in replica_tags(ep.app_name, "LLMStage"):  # 72 frames: >= 5 s of decoding, so the lost
            _pace_forward(ep.app_name, tag, 0.01)  # replica surely steps again after the fault is armed
        jobs = [_job(f"lost-{i}", f"device lost {i}", seed=i if i % 2 else None) for i in range(4)]
        outcomes, threads = _play_all(ep, jobs)
        _wait_until_all_play(outcomes)
        lost = _replica_of_a_playing_stream(outcomes)
        lost_actor = _replica_actor(ep.app_name, lost)
        on_lost = [rid for rid, o in outcomes.items() if o.chunks[0].llm_replica == lost and not o.chunks[-1].final]
        assert on_lost, "the lost replica's streams ended before the fault: make them longer"
        _fail_next_forward(ep.app_name, lost, "device")
        assert _has_ended(lost_actor)  # its process ended itself (Serve does not restart replica actors)
        for thread in threads:
            thread.join(timeout=120)
        _check_audio(outcomes, jobs, DEVICE_LOST_APP.engine)  # every stream finished, as if never lost
        for rid in on_lost:  # resumed on the other replica
            assert len({c.llm_replica for c in outcomes[rid].chunks}) == 2, rid
    finally:
        serve.delete(ep.app_name)

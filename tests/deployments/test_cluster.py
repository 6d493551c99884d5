"""The disaggregated cluster under a real local Ray + Serve (CPU): streams, dispatch, admission,
cancellation and bad input over gRPC and HTTP."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import requests
from ray import serve

from cluster.client import make_request
from cluster.pipeline import InProcessPipeline
from core.config import EngineConfig
from protos import voxray_pb2, voxray_pb2_grpc
from tests.deployments.conftest import DATA_PARALLEL, TIGHT, call_replica
from tests.deployments.grpc_helpers import retry_delay_s, run_stream

pytestmark = pytest.mark.slow
SPF = 2048


def in_process_audio(jobs: list[dict], engine: EngineConfig = DATA_PARALLEL.engine) -> dict[str, bytes]:
    pipeline = InProcessPipeline(engine)
    for job in jobs:
        pipeline.submit(job["request_id"], job["text"], job["voice"], job["sampling"])
    audio: dict[str, bytes] = {job["request_id"]: b"" for job in jobs}
    for chunk in pipeline.stream():
        audio[chunk.req_id] += chunk.pcm16
    return audio


def test_eight_concurrent_streams_match_in_process_and_use_both_llm_replicas(cluster):
    ep = cluster["dp"]
    jobs = [
        {"request_id": f"dp-{i}", "text": f"stream number {i} " * (1 + i % 3), "voice": "leah",
         "sampling": {"seed": 100 + i, "max_tokens": 7 * (3 + i)}}
        for i in range(8)
    ]  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda job: run_stream(ep.grpc_target, ep.app_name, **job), jobs))
    expected = in_process_audio(jobs)
    replicas = set()
    for job, outcome in zip(jobs, outcomes, strict=True):
        assert outcome.code == grpc.StatusCode.OK, outcome.details
        got = np.frombuffer(outcome.pcm16, dtype="<i2").astype(np.int32)
        want = np.frombuffer(expected[job["request_id"]], dtype="<i2").astype(np.int32)
        assert got.shape == want.shape == (job["sampling"]["max_tokens"] // 7 * SPF,)
        assert np.abs(got - want).max() <= 2  # same tokens; float noise of batched decoding only
        assert [c.seq for c in outcome.chunks] == list(range(len(outcome.chunks)))
        assert outcome.chunks[-1].final and outcome.chunks[0].timings.ttfa_s > 0
        replicas |= {c.llm_replica for c in outcome.chunks}
    assert len(replicas) == 2


def test_overload_rejects_excess_quickly_and_admitted_streams_complete(cluster):
    ep = cluster["tight"]
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(
            pool.map(
                lambda i: run_stream(
                    ep.grpc_target, ep.app_name, f"overload {i}", sampling={"seed": i, "max_tokens": 140}
                ),
                range(8),
            )
        )
    rejected = [o for o in outcomes if o.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    admitted = [o for o in outcomes if o.code == grpc.StatusCode.OK]
    limit = TIGHT.admission.max_streams_per_replica + TIGHT.admission.max_queued_per_replica
    assert len(admitted) + len(rejected) == 8 and len(admitted) <= limit and len(rejected) >= 8 - limit
    assert all(o.finished_after_s < 1.0 and "retry after" in o.details for o in rejected)
    retry_s = TIGHT.admission.retry_after_s
    assert all(retry_delay_s(o.trailers) == retry_s for o in rejected)  # google.rpc.RetryInfo
    assert all(o.trailers["retry-after-ms"] == str(round(retry_s * 1000)) for o in rejected)
    assert all(len(o.pcm16) == 20 * SPF * 2 and o.chunks[-1].final for o in admitted)
    # Once the replicas are idle the Router admits at once: its load board counts the streams that
    # ended after the last report was measured (it used to reject until the next report arrived).
    give_up_s = time.time() + 30
    while _idle_since(ep.app_name) is None and time.time() < give_up_s:
        time.sleep(0.05)
    after = run_stream(ep.grpc_target, ep.app_name, "right after the burst", sampling={"max_tokens": 14})
    assert after.code == grpc.StatusCode.OK, after.details


def test_llm_replica_reports_the_detok_stages_measured_pace(cluster):
    """Admission predicts both stages: after a stream, the LLM replica's load carries the detok
    replicas' measured pace (their reports reach it through the detok handle's router)."""
    ep = cluster["dp"]
    assert run_stream(ep.grpc_target, ep.app_name, "detok pace", sampling={"max_tokens": 70}).code == grpc.StatusCode.OK
    detok = serve.get_deployment_handle("DetokStage", ep.app_name)
    assert detok.record_routing_stats.remote().result()["step_s_by_chunks"]  # measured decode steps
    llm = serve.get_deployment_handle("LLMStage", ep.app_name)
    give_up_s = time.time() + 30  # the next routing-stats report carries it to the LLM replicas
    while time.time() < give_up_s:
        loads = [llm.stats.remote().result() for _ in range(4)]
        if any(load["detok_real_time_streams"] > 0 and load["detok_first_chunk_s"] > 0 for load in loads):
            break
        time.sleep(0.1)
    assert any(load["detok_real_time_streams"] > 0 for load in loads), loads


def test_both_stages_trace_their_serving_loops_steps(cluster):
    """`loop_trace()` (the planner's stall measurement reads it): a stream's steps, each with its batch size,
    on the replica that served it; the detokenizer's batches likewise."""
    ep = cluster["dp"]
    since_s = time.monotonic()  # one box: the replicas' monotonic clock is this one
    outcome = run_stream(ep.grpc_target, ep.app_name, "loop trace", sampling={"max_tokens": 70})
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    served_by = {"LLMStage": {c.llm_replica for c in outcome.chunks},
                 "DetokStage": {c.detok_replica for c in outcome.chunks}}  # fmt: skip
    for stage, least in (("LLMStage", 60), ("DetokStage", 1)):
        # asked of the replicas that served the stream (a handle picks its own: the LLM router the idle one)
        traces = [call_replica(ep.app_name, tag, "loop_trace", since_s) for tag in served_by[stage]]
        busiest = max(traces, key=lambda t: len(t["size"]))
        assert len(busiest["size"]) >= least and min(busiest["size"]) >= 1, (stage, busiest["size"][:10])
        assert all(start >= since_s for start in busiest["start_s"]) and busiest["now_s"] > since_s
        assert busiest["replica"].startswith(f"{stage}#")  # loadtest.loop_stalls tells the replicas apart by it


def test_both_stages_warmed_up_at_their_largest_shapes_before_serving(cluster):
    """Each replica ran its engine once at its largest shapes before it took a request
    (`engine.warm_up`): its memory's high water is reached at start, not under traffic."""
    app = cluster["tight"].app_name
    for stage in ("LLMStage", "DetokStage"):
        assert serve.get_deployment_handle(stage, app).stats.remote().result()["warm_up_s"] > 0


def _idle_since(app: str) -> float | None:
    """Wall-clock time at which both stages reported no state for any request (None if they hold some)."""
    llm = serve.get_deployment_handle("LLMStage", app).stats.remote().result()
    detok = serve.get_deployment_handle("DetokStage", app).stats.remote().result()
    idle = llm["kv_slots_used"] == 0 and llm["engine_requests"] == 0 and detok["queued_chunks"] == 0
    return max(llm["at_s"], detok["at_s"]) if idle else None


def test_client_disconnect_frees_kv_slot_and_detok_state(cluster):
    ep = cluster["tight"]
    channel = grpc.insecure_channel(ep.grpc_target)
    stub = voxray_pb2_grpc.SpeechStub(channel)
    request = voxray_pb2.SynthesizeRequest(text="a long one", sampling=voxray_pb2.SamplingOptions(max_tokens=1400))
    call = stub.Synthesize(request, metadata=(("application", ep.app_name),))
    next(call)
    llm = serve.get_deployment_handle("LLMStage", ep.app_name).stats.remote().result()
    assert llm["kv_slots_used"] == 1
    cancelled_at = time.time()
    call.cancel()
    channel.close()
    idle_at = None
    while idle_at is None and time.time() - cancelled_at < 10:
        idle_at = _idle_since(ep.app_name)
        time.sleep(0.05)
    assert idle_at is not None and idle_at - cancelled_at < 1.0, "KV slot / detok state held >= 1 s after disconnect"


GRPC_BAD_INPUT = [
    ({"text": ""}, "text"),
    ({"text": "hi", "model": "nope"}, "model"),
    ({"text": "hi", "voice": "nobody"}, "voice"),
    ({"text": "hi", "sampling": {"temperature": -1.0}}, "sampling.temperature"),
    ({"text": "hi", "sampling": {"top_p": 1.5}}, "sampling.top_p"),
    ({"text": "x" * 5000}, "text"),
    ({"text": "hi", "sample_rate_hz": 8000}, "sample_rate_hz"),
]


@pytest.mark.parametrize(("kwargs", "field"), GRPC_BAD_INPUT)
def test_grpc_bad_input_is_invalid_argument_naming_field(cluster, kwargs, field):
    ep = cluster["tight"]
    outcome = run_stream(ep.grpc_target, ep.app_name, **kwargs)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    assert outcome.details.startswith(f"{field}:")


HTTP_BAD_INPUT = [
    ({"json": {"input": ""}}, 400, "input"),
    ({"json": {"input": "hi", "model": "nope"}}, 400, "model"),
    ({"json": {"input": "hi", "voice": "nobody"}}, 400, "voice"),
    ({"json": {"input": "hi", "response_format": "mp3"}}, 400, "response_format"),
    ({"json": {"input": "hi", "sampling": {"top_k": -2}}}, 400, "sampling.top_k"),
    ({"json": {"input": "x" * 5000}}, 400, "input"),
    ({"json": {"input": "hi", "colour": "red"}}, 400, "colour"),
    ({"data": "input=hi", "headers": {"content-type": "application/x-www-form-urlencoded"}}, 415, "content-type"),
    ({"data": "{not json", "headers": {"content-type": "application/json"}}, 400, "body"),
]


@pytest.mark.parametrize(("kwargs", "status", "param"), HTTP_BAD_INPUT)
def test_http_bad_input_is_4xx_naming_field(cluster, kwargs, status, param):
    resp = requests.post(cluster["tight"].http_url + "/v1/audio/speech", timeout=30, **kwargs)
    assert resp.status_code == status
    assert resp.json()["error"]["param"] == param


def test_server_keeps_serving_after_bad_input_http_and_grpc(cluster):
    ep = cluster["tight"]
    resp = requests.post(
        ep.http_url + "/v1/audio/speech",
        json={"input": "still here", "response_format": "wav", "sampling": {"max_tokens": 35, "seed": 3}},
        timeout=120,
    )
    assert resp.status_code == 200 and resp.headers["content-type"] == "audio/wav"
    assert resp.content[:4] == b"RIFF" and len(resp.content) == 44 + 5 * SPF * 2
    outcome = run_stream(ep.grpc_target, ep.app_name, "and here", sampling={"max_tokens": 14})
    assert outcome.code == grpc.StatusCode.OK and len(outcome.pcm16) == 2 * SPF * 2
    assert requests.get(ep.http_url + "/healthz", timeout=10).json()["status"] == "ok"


def test_list_models_and_voices(cluster):
    ep = cluster["tight"]
    with grpc.insecure_channel(ep.grpc_target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        meta = (("application", ep.app_name),)
        models = stub.ListModels(voxray_pb2.ListModelsRequest(), metadata=meta)
        voices = stub.ListVoices(voxray_pb2.ListVoicesRequest(), metadata=meta)
    assert [m.name for m in models.models] == ["orpheus-tiny"] and models.models[0].sample_rate_hz == 24000
    assert "tara" in voices.voices and voices.default_voice == "tara"


def test_duplicate_request_id_is_rejected_without_harming_the_running_stream(cluster):
    ep = cluster["tight"]
    with grpc.insecure_channel(ep.grpc_target) as channel:
        job = {"request_id": "dup-1", "text": "one", "voice": None, "sampling": {"seed": 5, "max_tokens": 7 * 60}}
        request = make_request(job["text"], request_id=job["request_id"], sampling=job["sampling"])  # plays long
        first = voxray_pb2_grpc.SpeechStub(channel).Synthesize(request, metadata=(("application", ep.app_name),))
        chunks = [next(first)]  # the first stream is playing: its id is taken
        second = run_stream(ep.grpc_target, ep.app_name, "two", request_id="dup-1", sampling={"max_tokens": 7})
        chunks += list(first)
    assert second.code == grpc.StatusCode.INVALID_ARGUMENT and second.details.startswith("request_id:")
    got = np.frombuffer(b"".join(c.audio for c in chunks), dtype="<i2").astype(np.int32)
    want = np.frombuffer(in_process_audio([job], TIGHT.engine)["dup-1"], dtype="<i2").astype(np.int32)
    assert chunks[-1].final and got.shape == want.shape and np.abs(got - want).max() <= 2  # untouched by the dup


def _stage_stats(name: str, app_name: str) -> dict:
    return serve.get_deployment_handle(name, app_name).stats.remote().result()


def test_audio_bypasses_the_llm_replica_and_chunks_travel_in_step_batches(cluster):
    """The LLM replica forwards AudioRefs, never audio: every chunk reaches the client from the
    detok replica that decoded it, in at most one decode call per chunk (whether two streams cut
    chunks in the same step is timing; tests/deployments/test_llm_stage_batches.py pins the
    grouping)."""
    ep = cluster["tight"]  # one LLM replica: its counters cover every stream below
    before = _stage_stats("LLMStage", ep.app_name)
    jobs = [{"request_id": f"byref-{i}", "text": f"by reference {i}", "sampling": {"seed": i, "max_tokens": 140}}
            for i in range(2)]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda job: run_stream(ep.grpc_target, ep.app_name, **job), jobs))
    assert all(o.code == grpc.StatusCode.OK for o in outcomes), [o.details for o in outcomes]
    num_chunks = sum(len(o.chunks) for o in outcomes)
    assert all(c.detok_replica.startswith("DetokStage#") for o in outcomes for c in o.chunks)
    after = _stage_stats("LLMStage", ep.app_name)
    assert after["audio_refs"] - before["audio_refs"] == num_chunks
    assert 0 < after["decode_calls"] - before["decode_calls"] <= num_chunks


def test_llm_stage_events_carry_refs_not_audio(cluster):
    import ray

    from core.messages import Admitted, AudioReady, Job, SamplingParams

    ep = cluster["tight"]
    llm = serve.get_deployment_handle("LLMStage", ep.app_name).options(stream=True)
    job = Job("events-1", "hello there", None, SamplingParams(max_tokens=70, seed=0), ttfa_deadline_s=30.0)
    events = list(llm.generate.remote(job))
    assert isinstance(events[0], Admitted)
    assert events[1:] and all(isinstance(e, AudioReady) for e in events[1:])
    assert all(isinstance(e.ref.handle, ray.ObjectRef) for e in events[1:])
    steps = [ray.get(e.ref.handle) for e in events[1:]]  # one object per decode call: the step's audio
    pairs = list(zip(events[1:], steps, strict=True))
    assert all(isinstance(step, list) and 0 <= e.ref.index < len(step) for e, step in pairs)
    audio = [step[e.ref.index] for e, step in pairs]
    assert [a.seq for a in audio] == [e.ref.seq for e in events[1:]] == list(range(len(audio)))
    assert sum(len(a.pcm16) for a in audio) == 10 * SPF * 2 and audio[-1].is_final
    assert all(a.detok_replica.startswith("DetokStage#") for a in audio)


def test_embedded_ray_runs_replicas_at_normal_priority(cluster):
    """The embedded Ray starts its workers (the replicas, engines included; a task here reads the
    same raylet setting) at niceness 0, not Ray's 15, which put them behind every other process
    on a small machine."""
    import os

    import ray

    from cluster.server import EMBEDDED_WORKER_NICENESS, WORKER_NICENESS_ENV

    if WORKER_NICENESS_ENV in os.environ:
        pytest.skip(f"{WORKER_NICENESS_ENV} is set: Ray uses it")
    def niceness() -> int:
        return os.nice(0)

    worker_niceness = ray.get(ray.remote(num_cpus=0)(niceness).remote())
    assert worker_niceness == EMBEDDED_WORKER_NICENESS == 0

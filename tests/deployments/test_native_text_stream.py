"""Native text streaming (issue 27) under a real local Ray + Serve: qwen3-tts-tiny on two LLM
and two detok replicas, incremental WebSocket streams typed word by word. Each stream is one
streaming-text request fed its pieces on the replica that runs it (the request router pins them
there), waiting for text with its KV held; its audio equals the in-process engine's for the whole
text at once (the stateful detokenizer decodes each stream on the one detok replica it is pinned
to, in seq order, whichever decode call brings its chunks first)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from ray import serve

from cluster.drain import live_llm_replicas
from cluster.pipeline import InProcessPipeline
from core.config import AdmissionConfig, EngineConfig, ModelConfig, StageDeploymentConfig
from core.messages import Job
from tests.deployments.conftest import call_replica, replica_tags, small_config
from tests.deployments.test_zz_rebalance import _replica_stats

pytestmark = pytest.mark.slow
AGENTS = small_config(
    app_name="voxray-agents", route_prefix="/agents", engine=EngineConfig(model=ModelConfig(name="qwen3-tts-tiny")),
    llm=StageDeploymentConfig(num_replicas=2, num_cpus=0.25),
    detok=StageDeploymentConfig(num_replicas=2, num_cpus=0.125),  # (the test cluster has 1 CPU left for it)
    router=StageDeploymentConfig(num_cpus=0.25),
    admission=AdmissionConfig(max_streams_per_replica=4, max_queued_per_replica=4, default_ttfa_deadline_s=120.0),
)  # fmt: skip
WORDS = ["Hello ", "there, ", "my ", "good ", "friend."]
SEEDS = (9, 10, 26)  # seeds whose stream reads all 29 text ids before its EOS (34-37 frames; the tiny
# model stops at random: re-pick them when the sampler's draws change)
SAMPLING = {"max_tokens": 80}


@pytest.fixture(scope="module")
def agents(cluster):
    from cluster.server import deploy_app

    ep = deploy_app(AGENTS)
    yield ep
    serve.delete(AGENTS.app_name)


def ws_messages(ws) -> tuple[list, int]:
    from websockets.exceptions import ConnectionClosed

    got = []
    try:
        while True:
            message = ws.recv(timeout=120)
            got.append(json.loads(message) if isinstance(message, str) else message)
    except ConnectionClosed as closed:
        return got, closed.rcvd.code if closed.rcvd else -1


def typed_stream(ep, index: int) -> tuple[bytes, int, list]:
    """One WebSocket stream: a word, its first audio, then the other words 0.15 s apart, then end."""
    from websockets.sync.client import connect

    url = ep.http_url.replace("http://", "ws://", 1) + AGENTS.route_prefix + "/v1/audio/speech/stream"
    with connect(url, open_timeout=60) as ws:
        config = {"voice": "ryan", "sampling": {"seed": SEEDS[index], **SAMPLING}, "request_id": f"nat-{index}"}
        ws.send(json.dumps(config))
        assert json.loads(ws.recv(timeout=60))["type"] == "ready"
        for word in WORDS:
            ws.send(json.dumps({"text": word}))
            time.sleep(0.15)
        _wait_until(lambda: streams_waiting_for_text() >= 1, 60.0)  # one has read all its text: it waits for its end
        ws.send(json.dumps({"end": True}))
        got, code = ws_messages(ws)
    metas = [m for m in got if isinstance(m, dict)]
    audio = b"".join(m for m in got if isinstance(m, bytes))
    return audio, code, metas


def whole_text_audio(index: int) -> bytes:
    pipeline = InProcessPipeline(AGENTS.engine)
    adapter = pipeline.llm.engine.adapter
    sampling = adapter.default_sampling.model_copy(update={"seed": SEEDS[index], **SAMPLING})
    pipeline.add_job(Job(f"whole-{index}", "".join(WORDS), "ryan", sampling, 60.0, text_streaming=True))
    pipeline.llm.engine.push_text(f"whole-{index}", end=True)
    return b"".join(chunk.pcm16 for chunk in pipeline.stream())


def streams_waiting_for_text() -> int:
    """Streams idle for text now, on every LLM replica."""
    app = AGENTS.app_name
    return sum(_replica_stats(app, replica)["waiting_for_text"] for replica in live_llm_replicas(app))


def _wait_until(condition, timeout_s: float) -> None:
    give_up_s = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < give_up_s:
        time.sleep(0.05)


def text_waits() -> int:
    """Times a stream had run out of text when more came, on every LLM replica (a handle's stats
    call reaches one replica only). Each stream sends its end only once one stream waits for text
    (the last word is held until the end), so a wait is certain however slow the machine; the
    counter then proves that stream was waiting, holding its KV, when its end came."""
    app = AGENTS.app_name
    return sum(_replica_stats(app, replica)["text_waits"] for replica in live_llm_replicas(app))


def test_typed_streams_on_two_replicas_equal_the_whole_text_and_wait_holding_kv(agents):
    waits_before = text_waits()
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda i: typed_stream(agents, i), range(3)))
    for index, (audio, code, metas) in enumerate(results):
        assert code == 1000 and metas[-1]["type"] == "done", metas[-1]
        assert {m["segment"] for m in metas if m["type"] == "audio"} == {0}  # one request, not segments
        want = np.frombuffer(whole_text_audio(index), dtype="<i2").astype(np.int32)
        got = np.frombuffer(audio, dtype="<i2").astype(np.int32)
        assert got.shape == want.shape and got.size > 0
        assert np.abs(got - want).max() <= 2  # same frames; float noise of batched decoding only
    assert text_waits() - waits_before >= 1  # a stream ran out of text and waited on its replica
    # (a piece routed to the other replica would be refused there, and its stream would wait for
    # text until the idle timeout: the audio above shows every piece reached its stream)


def test_grpc_bidi_stream_of_typed_words_equals_the_whole_text(agents):
    """The same native stream over the bidi `SynthesizeStream` (the client's half-close ends its text)."""
    import grpc

    from protos import voxray_pb2, voxray_pb2_grpc

    def requests():
        sampling = voxray_pb2.SamplingOptions(seed=SEEDS[0], max_tokens=SAMPLING["max_tokens"])
        config = voxray_pb2.SynthesizeRequest(voice="ryan", request_id="nat-grpc", sampling=sampling)
        yield voxray_pb2.SynthesizeStreamRequest(config=config)
        for word in WORDS:
            yield voxray_pb2.SynthesizeStreamRequest(text=word)
            time.sleep(0.15)

    with grpc.insecure_channel(agents.grpc_target) as channel:
        chunks = list(voxray_pb2_grpc.SpeechStub(channel).SynthesizeStream(requests(), timeout=120))
    assert chunks[-1].final and [c.seq for c in chunks] == list(range(len(chunks)))
    assert len({c.detok_replica for c in chunks}) == 1  # the stream is pinned to one of the two detok replicas
    got = np.frombuffer(b"".join(c.audio for c in chunks), dtype="<i2").astype(np.int32)
    want = np.frombuffer(whole_text_audio(0), dtype="<i2").astype(np.int32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 2


def waiting_for_text(app_name: str) -> int:
    """Streams idle for text on every LLM replica of `app_name`, asked of each (a handle picks the idle one)."""
    return sum(call_replica(app_name, tag, "stats")["waiting_for_text"] for tag in replica_tags(app_name, "LLMStage"))


def test_zz_drain_ends_a_stream_waiting_for_text_with_its_final_chunk(agents):
    """(last here: it drains the app) A stream whose client went quiet ends at once, cleanly: the
    rest of its audio, an empty final, `done`, close 1000, long before the idle timeout (30 s)."""
    from websockets.sync.client import connect

    from router.drain import clear_drain, start_drain

    url = agents.http_url.replace("http://", "ws://", 1) + AGENTS.route_prefix + "/v1/audio/speech/stream"
    try:
        with connect(url, open_timeout=60) as ws:
            ws.send(json.dumps({"voice": "ryan", "sampling": {"seed": SEEDS[0], **SAMPLING}}))
            assert json.loads(ws.recv(timeout=60))["type"] == "ready"
            ws.send(json.dumps({"text": "Hi "}))
            deadline_s = time.monotonic() + 60
            while not (waiting := waiting_for_text(AGENTS.app_name)) and time.monotonic() < deadline_s:
                time.sleep(0.05)
            assert waiting == 1  # it read "Hi " and waits for more, holding its KV
            start_drain(AGENTS.app_name, grace_s=60.0)
            started_s = time.monotonic()
            got, code = ws_messages(ws)
        assert code == 1000 and got[-1]["type"] == "done" and time.monotonic() - started_s < 15.0
    finally:
        clear_drain(AGENTS.app_name)
        _wait_until(lambda: serves_again(agents), 20.0)  # the Routers poll the drain (router.drain.POLL_S)


def serves_again(ep) -> bool:
    import grpc

    from tests.deployments.grpc_helpers import run_stream

    return run_stream(ep.grpc_target, ep.app_name, "Hi.", sampling={"max_tokens": 16}).code == grpc.StatusCode.OK


def test_zz_a_typed_stream_whose_llm_replica_dies_resumes_with_its_text(agents):
    """(last here: it kills an LLM replica) A bidi stream of typed words; after its first audio the
    LLM replica running it is killed while words still come. The stream resumes on the other one
    from its last checkpoint with the text it was sent replayed, later words go there, and its
    audio equals the whole text's: no error, no word lost or read twice."""
    import threading

    import grpc
    import ray

    from protos import voxray_pb2, voxray_pb2_grpc
    from tests.deployments.test_zz_failover import _replica_actor

    first_audio, killed = threading.Event(), threading.Event()

    def requests():
        sampling = voxray_pb2.SamplingOptions(seed=SEEDS[0], max_tokens=SAMPLING["max_tokens"])
        config = voxray_pb2.SynthesizeRequest(voice="ryan", request_id="nat-lost", sampling=sampling)
        yield voxray_pb2.SynthesizeStreamRequest(config=config)
        yield voxray_pb2.SynthesizeStreamRequest(text=WORDS[0])
        first_audio.wait(60)
        yield voxray_pb2.SynthesizeStreamRequest(text=WORDS[1])  # reaches the replica about to die
        killed.wait(60)
        for word in WORDS[2:]:  # sent while the stream resumes, or to the replica that resumed it
            yield voxray_pb2.SynthesizeStreamRequest(text=word)
            time.sleep(0.15)

    def running_it() -> str:  # the one stream here: on the replica whose engine holds a request
        return next(r for r in live_llm_replicas(app) if _replica_stats(app, r)["engine_requests"])

    app, chunks = AGENTS.app_name, []
    with grpc.insecure_channel(agents.grpc_target) as channel:
        for chunk in voxray_pb2_grpc.SpeechStub(channel).SynthesizeStream(requests(), timeout=120):
            chunks.append(chunk)
            if not first_audio.is_set():
                first_audio.set()
                victim = running_it()
                time.sleep(0.2)  # WORDS[1] goes out meanwhile
                ray.kill(_replica_actor(app, f"LLMStage#{victim}"), no_restart=True)
                killed.set()
    assert chunks[-1].final and [c.seq for c in chunks] == list(range(len(chunks)))
    got = np.frombuffer(b"".join(c.audio for c in chunks), dtype="<i2").astype(np.int32)
    want = np.frombuffer(whole_text_audio(0), dtype="<i2").astype(np.int32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 2

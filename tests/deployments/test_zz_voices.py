"""Zero-shot voices through the running test cluster with `cosyvoice2-tiny` (1 LLM : 2 detok replicas):
register over HTTP and gRPC, synthesize with the voice over both; the voice's tensors reach the
flow detokenizer and change its audio deterministically; they cross the stage boundary over RDT
gloo once per detok replica, as the transport's own counters on both ends show; bad clips and
unknown voices are refused naming the field. (The object-store backend of the same endpoints is
tests/deployments/test_transport.py's; in the serving path it carries the rebalance test's KV.)"""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import ray
import requests
from ray import serve

from cluster.server import deploy_app
from core.config import AdmissionConfig, EngineConfig, ModelConfig, StageDeploymentConfig, VoicesConfig
from protos import voxray_pb2, voxray_pb2_grpc
from tests.deployments.conftest import deployment_actor_names, small_config
from tests.deployments.grpc_helpers import run_stream
from tests.detok_stage.test_voice_clip import wav_bytes

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0, "max_tokens": 60}  # same tokens whatever the voice (no transcript: LM unchanged)
MAX_PCM_STEPS = 8  # S3Gen in another batch composition: float noise through the NSF phase, PCM16 rounding
TEXT = "A voice from a clip."


def voices_config(transport: str):
    app = "voxray-voices" if transport == "gloo" else "voxray-voices-os"
    return small_config(
        app_name=app, route_prefix=f"/{app}",
        engine=EngineConfig(model=ModelConfig(name="cosyvoice2-tiny", torch_threads=1)),
        llm=StageDeploymentConfig(num_cpus=0.25), detok=StageDeploymentConfig(num_cpus=0.25, num_replicas=2),
        router=StageDeploymentConfig(num_cpus=0.25), voices=VoicesConfig(transport=transport),
        admission=AdmissionConfig(max_streams_per_replica=4, max_queued_per_replica=4, default_ttfa_deadline_s=120.0),
    )  # fmt: skip


@pytest.fixture(scope="module")
def voices_app(cluster):
    config = voices_config("gloo")
    endpoints = deploy_app(config)
    try:
        yield config, endpoints
    finally:
        serve.delete(config.app_name)
    assert not _banks(config.app_name)  # the VoiceBank went with the app (a deployment actor, not detached)


def _banks(app_name: str) -> list[str]:
    """Named VoiceBank actors of `app_name` still alive (Serve's deployment actor of its DetokStage)."""
    return deployment_actor_names(app_name, "DetokStage", "voice_bank")


def register_grpc(target: str, app: str, audio: bytes, prompt_text: str = ""):
    with grpc.insecure_channel(target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        request = voxray_pb2.RegisterVoiceRequest(audio=audio, prompt_text=prompt_text)
        return stub.RegisterVoice(request, metadata=(("application", app),), timeout=120)


def register_http(url: str, audio: bytes, **fields) -> requests.Response:
    body = {"audio": base64.b64encode(audio).decode(), **fields}
    return requests.post(url + "/v1/voices", json=body, timeout=120)


def pcm(outcome) -> np.ndarray:
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    return np.frombuffer(outcome.pcm16, dtype="<i2").astype(np.int32)


def test_a_registered_voice_conditions_the_detokenizer_over_the_transport(voices_app):
    config, ep = voices_app
    url = ep.http_url + config.route_prefix
    clip_a, clip_b = wav_bytes(seconds=2.0, amplitude=0.3), wav_bytes(seconds=3.0, rate=16_000, amplitude=0.5)
    resp = register_http(url, clip_a)
    assert resp.status_code == 200, resp.text
    voice_a = resp.json()["id"]
    assert resp.json()["created"] and resp.json()["prompt_tokens"] == 50  # 2 s at 25 Hz
    reply = register_grpc(ep.grpc_target, ep.app_name, clip_b)
    voice_b = reply.voice_id
    assert reply.created and reply.prompt_tokens == 75 and voice_b != voice_a
    again = register_grpc(ep.grpc_target, ep.app_name, clip_a)
    assert again.voice_id == voice_a and not again.created  # content-addressed: encoded once
    assert set(requests.get(url + "/v1/voices", timeout=30).json()["registered"]) == {voice_a, voice_b}

    jobs = [("a1", voice_a), ("a2", voice_a), ("a3", voice_a), ("b", voice_b), ("none", "")]
    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: the two detok replicas share the streams
        outcomes = dict(zip([j for j, _ in jobs], pool.map(
            lambda job: run_stream(ep.grpc_target, ep.app_name, TEXT, request_id=job[0], voice=job[1], sampling=GREEDY),
            jobs,
        ), strict=True))  # fmt: skip
    audio = {name: pcm(outcome) for name, outcome in outcomes.items()}
    assert all(a.size == audio["a1"].size > 0 for a in audio.values())  # greedy: the same tokens for every voice
    for other in ("a2", "a3"):  # the same voice, decoded by either replica: the same audio
        assert np.abs(audio[other] - audio["a1"]).max() <= MAX_PCM_STEPS
    for other in ("b", "none"):  # another voice, or none: other audio
        assert np.abs(audio[other] - audio["a1"]).max() > 50 * MAX_PCM_STEPS

    http = requests.post(url + "/v1/audio/speech", json={"input": TEXT, "voice": voice_a, "response_format": "pcm",
                                                         "sampling": GREEDY}, timeout=120)  # fmt: skip
    assert http.status_code == 200, http.text
    assert np.abs(np.frombuffer(http.content, dtype="<i2").astype(np.int32) - audio["a1"]).max() <= MAX_PCM_STEPS

    # with a transcript, the LM is prompted with it and the clip's speech tokens too (CosyVoice's zero-shot mode)
    voice_c = register_grpc(ep.grpc_target, ep.app_name, clip_a, prompt_text="A tone, not a voice.").voice_id
    prompted = [run_stream(ep.grpc_target, ep.app_name, TEXT, voice=voice_c, sampling=GREEDY) for _ in range(2)]
    assert voice_c not in (voice_a, voice_b) and np.array_equal(pcm(prompted[0]), pcm(prompted[1]))

    assert len(_banks(ep.app_name)) == 1
    bank = serve.get_deployment_handle("DetokStage", ep.app_name).voice_bank.remote().result(timeout_s=60)
    stats, sinks = ray.get(bank.stats.remote()), ray.get(bank.sink_stats.remote())
    served_a = {c.detok_replica for name in ("a1", "a2", "a3") for c in outcomes[name].chunks}
    assert stats["transport"] == config.voices.transport and stats["encoded"] == 3
    assert all(count == 1 for count in stats["deliveries_by"].values())  # once per voice and replica
    delivered_a = {key.split("@", 1)[1] for key in stats["deliveries_by"] if key.startswith(voice_a)}
    assert served_a <= delivered_a and len(delivered_a) <= 2  # every replica that decoded voice A got it, once
    assert len(sinks) == len(stats["replicas"]) <= 2
    received = sum(s["received"] for s in sinks.values())
    assert stats["source"]["sent"] == received == stats["deliveries"] == len(stats["deliveries_by"])
    assert stats["source"]["bytes_sent"] == sum(s["bytes_received"] for s in sinks.values()) == stats["bytes_delivered"]
    print(f"{config.voices.transport}: {stats['deliveries']} deliveries, {stats['bytes_delivered']} bytes, "
          f"voice A decoded on {sorted(served_a)}")  # fmt: skip


@pytest.mark.parametrize(
    "audio, words",
    [
        (b"", "is empty"),
        (b"not audio, just text", "is not a PCM WAV"),
        (wav_bytes(rate=8_000), "sample rate 8000 Hz"),
        (wav_bytes(seconds=0.3), "s long"),
        (wav_bytes(seconds=21.0, rate=16_000), "s long"),
    ],
    ids=["empty", "not-audio", "rate", "short", "long"],
)
def test_bad_clips_are_refused_over_grpc_and_http(voices_app, audio, words):
    config, ep = voices_app
    with pytest.raises(grpc.RpcError) as err:
        register_grpc(ep.grpc_target, ep.app_name, audio)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "audio" in err.value.details()
    assert words in err.value.details()
    resp = register_http(ep.http_url + config.route_prefix, audio)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "audio" and words in resp.text


def test_unknown_voices_are_refused_naming_the_field(voices_app):
    config, ep = voices_app
    unknown = "v_" + "f" * 24
    outcome = run_stream(ep.grpc_target, ep.app_name, TEXT, voice=unknown, sampling=GREEDY)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT and "voice" in outcome.details, outcome.details
    resp = requests.post(ep.http_url + config.route_prefix + "/v1/audio/speech",
                         json={"input": TEXT, "voice": unknown}, timeout=60)  # fmt: skip
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "voice"
    resp = requests.post(ep.http_url + config.route_prefix + "/v1/voices", json={"audio": "%%%"}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "audio"

"""Four models in one app on the test cluster: orpheus-tiny and csm-tiny (each its own LLM and detok
deployment) and cosyvoice2-tiny + chatterbox-tiny, whose LLM deployments share one S3Gen
DetokStage. Requests are routed by `model`, an unknown one is INVALID_ARGUMENT / 400 naming it,
ListModels and /v1/models list the four, a full model refuses while another admits, and the
router's series carry each model's tag. (Routing and admission logic in detail:
tests/router/test_served.py; the plan: tests/deployments/test_model_plan.py.)"""

from __future__ import annotations

import queue
import re
import time

import grpc
import pytest
import requests
from ray import serve

from cluster.cli import main
from core.config import AdmissionConfig, ServeConfig, StageDeploymentConfig
from protos import voxray_pb2, voxray_pb2_grpc
from tests.deployments.conftest import METRICS_PORT, small_config
from tests.deployments.grpc_helpers import run_stream

pytestmark = pytest.mark.slow
NAMES = ("orpheus-tiny", "csm-tiny", "cosyvoice2-tiny", "chatterbox-tiny")
SMALL = StageDeploymentConfig(num_cpus=0.1)
ONE_EACH = AdmissionConfig(max_streams_per_replica=1, max_queued_per_replica=0, default_ttfa_deadline_s=120.0)


def multi_config() -> ServeConfig:
    base = small_config(app_name="voxray-multi", route_prefix="/multi", router=SMALL, admission=ONE_EACH)
    models = [{"engine": {"model": {"name": name, "torch_threads": 1}, "cache": {"num_slots": 4},
                          "scheduler": {"max_batch_size": 4}},
               "llm": SMALL.model_dump(), "detok": SMALL.model_dump()} for name in NAMES]  # fmt: skip
    return ServeConfig.model_validate({**base.model_dump(exclude={"engine", "llm", "detok"}), "models": models})


@pytest.fixture(scope="module")
def multi(cluster):
    from cluster.server import deploy_app

    config = multi_config()
    endpoints = deploy_app(config)
    yield endpoints
    serve.delete(config.app_name)


def stream(ep, model: str, text: str = "Hello there."):
    return run_stream(ep.grpc_target, ep.app_name, text, model=model, sampling={"seed": 1, "max_tokens": 60})


def test_requests_are_routed_by_model_and_s3gen_models_share_a_detok_deployment(multi):
    detoks = {}
    for name in NAMES:
        outcome = stream(multi, name)
        assert outcome.code == grpc.StatusCode.OK, (name, outcome.details)
        assert outcome.chunks[-1].final and sum(len(c.audio) for c in outcome.chunks) > 0
        assert {c.llm_replica.split("#")[0] for c in outcome.chunks} == {f"LLMStage-{name}"}
        detoks[name] = {c.detok_replica for c in outcome.chunks if c.detok_replica}
    assert {r.split("#")[0] for r in detoks["orpheus-tiny"]} == {"DetokStage-snac"}
    assert {r.split("#")[0] for r in detoks["csm-tiny"]} == {"DetokStage-mimi"}
    assert detoks["cosyvoice2-tiny"] == detoks["chatterbox-tiny"]  # the one S3Gen replica decoded both
    assert {r.split("#")[0] for r in detoks["chatterbox-tiny"]} == {"DetokStage-s3gen"}
    assert set(serve.status().applications["voxray-multi"].deployments) == {
        "Router", "LLMStage-orpheus-tiny", "LLMStage-csm-tiny", "LLMStage-cosyvoice2-tiny",
        "LLMStage-chatterbox-tiny", "DetokStage-snac", "DetokStage-mimi", "DetokStage-s3gen",
    }  # fmt: skip


def test_listings_and_an_unknown_model(multi, capsys):
    with grpc.insecure_channel(multi.grpc_target) as channel:
        listed = voxray_pb2_grpc.SpeechStub(channel).ListModels(voxray_pb2.ListModelsRequest(), timeout=30)
    assert [m.name for m in listed.models] == list(NAMES)
    assert main(["models", "--target", multi.grpc_target, "--app", multi.app_name]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == list(NAMES)
    body = requests.get(multi.http_url + "/multi/v1/models", timeout=30).json()
    assert [item["id"] for item in body["data"]] == list(NAMES)
    unknown = stream(multi, "dia-tiny")
    assert unknown.code == grpc.StatusCode.INVALID_ARGUMENT and "model" in unknown.details
    assert "this server serves orpheus-tiny, csm-tiny, cosyvoice2-tiny, chatterbox-tiny" in unknown.details
    reply = requests.post(multi.http_url + "/multi/v1/audio/speech", json={"model": "dia-tiny", "input": "hi"},
                          timeout=30)  # fmt: skip
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"


def test_admission_is_per_model(multi):
    """One stream per replica (`ONE_EACH`): an orpheus-tiny incremental-text stream, admitted and
    counted for its whole life (it spoke its first sentence and waits for more text), fills that
    model, so a second orpheus request is refused, while csm-tiny still admits one."""
    pieces: queue.Queue = queue.Queue()

    def requests_in():
        sampling = voxray_pb2.SamplingOptions(seed=2, max_tokens=21)
        yield voxray_pb2.SynthesizeStreamRequest(config=voxray_pb2.SynthesizeRequest(model="orpheus-tiny",
                                                                                      sampling=sampling))  # fmt: skip
        while (item := pieces.get()) is not None:
            yield item

    with grpc.insecure_channel(multi.grpc_target) as channel:
        held = voxray_pb2_grpc.SpeechStub(channel).SynthesizeStream(requests_in(), timeout=120)
        pieces.put(voxray_pb2.SynthesizeStreamRequest(text="Hello there. "))
        try:
            assert next(held).seq == 0  # admitted and speaking: the stream holds orpheus-tiny's one place
            refused = stream(multi, "orpheus-tiny")
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details
            admitted = stream(multi, "csm-tiny")
            assert admitted.code == grpc.StatusCode.OK, admitted.details
        finally:
            pieces.put(None)  # half-close: the held stream ends
        assert list(held)[-1].final


def _router_series(name: str) -> dict[str, float]:
    """model tag -> the sum of series `name` over its other tags, from the cluster's Prometheus endpoint."""
    text = requests.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    by_model: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(rf'^{name}\{{([^}}]*)\}} ([0-9.eE+-]+)$', line)
        tags = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) if match else {}
        if match and tags.get("application") == "voxray-multi":
            by_model[tags.get("model", "")] = by_model.get(tags.get("model", ""), 0.0) + float(match.group(2))
    return by_model


def test_router_metrics_are_per_model(multi):
    """After the streams above (every model finished at least one; orpheus-tiny refused one), each
    model's series carry its tag. Polled: Ray exports every second here."""
    give_up_s = time.monotonic() + 60
    finished = _router_series("ray_voxray_streams_finished_total")
    while set(finished) < set(NAMES) and time.monotonic() < give_up_s:
        time.sleep(1)
        finished = _router_series("ray_voxray_streams_finished_total")
    assert set(finished) == set(NAMES) and all(count >= 1 for count in finished.values())
    rejections = _router_series("ray_voxray_admission_rejections_total")
    assert rejections.get("orpheus-tiny", 0) >= 1 and rejections.get("csm-tiny", 0) == 0

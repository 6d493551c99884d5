"""Ingress options under a real local Ray + Serve: /docs, /redoc, /openapi.json and gRPC reflection only
for an app whose config turns them on, and a gRPC deadline that cannot be met rejected at once."""

from __future__ import annotations

import time

import grpc
import pytest
import requests
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ray import serve

from cluster.client import make_request
from core.config import DetokConfig, ServeConfig, StageDeploymentConfig
from router.admission import predict_ttfa_s
from tests.deployments.conftest import small_config
from tests.deployments.grpc_helpers import run_stream

DOCS_APP = "voxray-docs"
DOC_PATHS = ("/docs", "/redoc", "/openapi.json")


@pytest.fixture(scope="module")
def docs_app(cluster):
    """An app with docs and reflection on, beside the session's apps (which have them off); its first
    chunk is 48 frames, so its first audio comes late enough for the deadline test (16 frames predicted
    0.15 s on a quiet 2-core box: half of it is too short a gRPC deadline to time)."""
    from cluster.server import deploy_app

    small = StageDeploymentConfig(num_cpus=0.25)
    slow_first_chunk = DetokConfig(first_chunk_frames=48, chunk_frames=48)  # a first audio the deadline test misses
    engine = ServeConfig().engine.model_copy(update={"detok": slow_first_chunk})
    config = small_config(app_name=DOCS_APP, route_prefix="/withdocs", http_docs=True, grpc_reflection=True,
                          llm=small, detok=small, engine=engine)  # fmt: skip
    yield deploy_app(config)
    serve.delete(DOCS_APP)


def _reflected(target: str) -> grpc.RpcError | list[str]:
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        try:
            [reply] = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
        except grpc.RpcError as err:
            return err
    return [service.name for service in reply.list_services_response.service]


def test_docs_only_where_configured(cluster, docs_app):
    tight = cluster["tight"]
    for path in DOC_PATHS:
        assert requests.get(tight.http_url + path, timeout=30).status_code == 404, path
        assert requests.get(docs_app.http_url + "/withdocs" + path, timeout=30).status_code == 200, path
    schema = requests.get(docs_app.http_url + "/withdocs/openapi.json", timeout=30).json()
    assert "/v1/audio/speech" in schema["paths"]


def test_grpc_reflection_only_where_configured(cluster, docs_app):
    off = _reflected(cluster["tight"].grpc_target)
    assert isinstance(off, grpc.RpcError) and off.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "voxray.Speech" in _reflected(docs_app.grpc_target)


def test_a_grpc_deadline_before_the_first_audio_is_rejected_at_once(docs_app):
    ok = run_stream(docs_app.grpc_target, DOCS_APP, "measure the pace", sampling={"max_tokens": 7 * 60})
    assert ok.code == grpc.StatusCode.OK
    time.sleep(1.5)  # the Router's view of the replica's load refreshes every 0.5 s
    predicted_s = predict_ttfa_s(serve.get_deployment_handle("LLMStage", DOCS_APP).load.remote().result())
    timeout_s = predicted_s / 2  # half the predicted first audio: the server has that long to refuse
    assert timeout_s >= 0.1, f"the app's first audio must come later than the test can time: {predicted_s} s"
    with grpc.insecure_channel(docs_app.grpc_target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        call = channel.unary_stream("/voxray.Speech/Synthesize", request_serializer=None)
        payload = make_request("hi").SerializeToString()
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            list(call(payload, timeout=timeout_s))
        elapsed_s = time.monotonic() - start
    err = caught.value
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "cannot start in time" in err.details(), err.details()
    assert elapsed_s < timeout_s and dict(err.trailing_metadata()).get("x-request-id")
    later = run_stream(docs_app.grpc_target, DOCS_APP, "in time", sampling={"max_tokens": 7})
    assert later.code == grpc.StatusCode.OK  # a deadline it can meet is served

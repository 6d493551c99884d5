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
from core.config import StageDeploymentConfig
from tests.deployments.conftest import small_config
from tests.deployments.grpc_helpers import run_stream

DOCS_APP = "voxray-docs"
DOC_PATHS = ("/docs", "/redoc", "/openapi.json")


@pytest.fixture(scope="module")
def docs_app(cluster):
    """An app with docs and reflection on, beside the session's apps (which have them off)."""
    from cluster.server import deploy_app

    small = StageDeploymentConfig(num_cpus=0.25)
    config = small_config(app_name=DOCS_APP, route_prefix="/withdocs", http_docs=True, grpc_reflection=True,
                          llm=small, detok=small)  # fmt: skip
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


def test_a_grpc_deadline_before_the_first_audio_is_rejected_at_once(cluster):
    ep = cluster["tight"]
    run_stream(ep.grpc_target, ep.app_name, "measure", sampling={"max_tokens": 14})  # the router knows the pace
    with grpc.insecure_channel(ep.grpc_target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        start = time.monotonic()
        call = channel.unary_stream("/voxray.Speech/Synthesize", request_serializer=None)
        payload = make_request("hi").SerializeToString()
        with pytest.raises(grpc.RpcError) as caught:
            list(call(payload, metadata=(("application", ep.app_name),), timeout=0.15))
    elapsed_s = time.monotonic() - start
    err = caught.value
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "cannot start in time" in err.details(), err.details()
    assert elapsed_s < 0.15 and dict(err.trailing_metadata()).get("x-request-id")
    assert run_stream(ep.grpc_target, ep.app_name, "after", sampling={"max_tokens": 7}).code == grpc.StatusCode.OK

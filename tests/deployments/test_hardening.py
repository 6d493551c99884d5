"""Issue 24 (ingress side) under a real local Ray + Serve: API keys and per-key quotas on both
protocols, malformed input from the wire (garbage protobuf included) answered INVALID_ARGUMENT /
400 naming the field with the request id, one log line and no traceback per client error, and
no stream left behind by requests that fail (the non-latin-1 request id lock-out)."""

from __future__ import annotations

import hashlib
import http.client
import json
import time
from pathlib import Path
from urllib.parse import urlparse

import grpc
import pytest
import requests
from ray import serve

from cluster.client import make_request
from core.config import AuthConfig, StageDeploymentConfig
from protos import voxray_pb2, voxray_pb2_grpc
from tests.deployments.conftest import small_config
from tests.deployments.grpc_helpers import StreamOutcome, retry_delay_s, run_stream

pytestmark = pytest.mark.slow
KEYS = ["k-grpc", "k-http", "k-rate-grpc", "k-rate-http", "k-streams", "k-gone"]
AUTH_APP = "voxray-auth"


@pytest.fixture(scope="module")
def auth_app(cluster, tmp_path_factory):
    """A third app on the session's Serve whose Router wants keys (1 stream, burst 3 at 0.1/s per key)."""
    from cluster.server import deploy_app

    path = tmp_path_factory.mktemp("auth") / "api-keys"
    path.write_text("".join(f"{hashlib.sha256(k.encode()).hexdigest()} {k}-name\n" for k in KEYS))
    auth = AuthConfig(api_keys_file=path, max_streams_per_key=1, requests_per_s_per_key=0.1, burst_per_key=3)
    small = StageDeploymentConfig(num_cpus=0.25)  # fits beside the session's two apps on 4 logical CPUs
    config = small_config(app_name=AUTH_APP, route_prefix="/auth", auth=auth, llm=small, detok=small)
    yield deploy_app(config)
    serve.delete(AUTH_APP)


def grpc_call(ep, method: str, request, key: str | None = None, app: str | None = None):
    """One unary call; returns (code, details, trailers)."""
    meta = [("application", app or ep.app_name)] + ([("authorization", f"Bearer {key}")] if key else [])
    with grpc.insecure_channel(ep.grpc_target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        try:
            getattr(stub, method)(request, metadata=meta, timeout=60)
            return grpc.StatusCode.OK, "", {}
        except grpc.RpcError as err:
            return err.code(), err.details(), dict(err.trailing_metadata() or ())


def raw_synthesize(ep, payload: bytes) -> grpc.RpcError | list:
    """Synthesize with hand-made request bytes (what a broken client sends)."""
    with grpc.insecure_channel(ep.grpc_target) as channel:
        call = channel.unary_stream(
            "/voxray.Speech/Synthesize", request_serializer=None, response_deserializer=voxray_pb2.AudioChunk.FromString
        )
        try:
            return list(call(payload, metadata=(("application", ep.app_name),), timeout=60))
        except grpc.RpcError as err:
            return err


# ---- authentication and per-key quotas ----------------------------------------------------


def test_grpc_needs_a_known_key(auth_app):
    ep = auth_app
    assert run_stream(ep.grpc_target, AUTH_APP, "hi").code == grpc.StatusCode.UNAUTHENTICATED
    assert _run_stream_with_key(ep, "k-unknown", "hi").code == grpc.StatusCode.UNAUTHENTICATED
    for key in (None, "k-unknown"):
        code, details, trailers = grpc_call(ep, "ListModels", voxray_pb2.ListModelsRequest(), key)
        assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("authorization:")
        assert "request id" in details and trailers.get("x-request-id")
    ok = _run_stream_with_key(ep, "k-grpc", "hello", sampling={"max_tokens": 14})
    assert ok.code == grpc.StatusCode.OK and ok.chunks[-1].final


def _run_stream_with_key(ep, key: str, text: str, **kwargs) -> StreamOutcome:
    outcome = StreamOutcome()
    meta = (("application", AUTH_APP), ("authorization", f"Bearer {key}"))
    with grpc.insecure_channel(ep.grpc_target) as channel:
        try:
            stub = voxray_pb2_grpc.SpeechStub(channel)
            outcome.chunks = list(stub.Synthesize(make_request(text, **kwargs), metadata=meta, timeout=120))
        except grpc.RpcError as err:
            outcome.code, outcome.details = err.code(), err.details()
    return outcome


def test_http_needs_a_known_key(auth_app):
    url = auth_app.http_url + "/auth/v1/audio/speech"
    body = {"input": "hello", "response_format": "pcm", "sampling": {"max_tokens": 14}}
    for headers in ({}, {"Authorization": "Bearer k-unknown"}, {"Authorization": "k-http"}):
        resp = requests.post(url, json=body, headers=headers, timeout=60)
        assert resp.status_code == 401 and resp.json()["error"]["param"] == "authorization"
        assert resp.headers["X-Request-Id"] == resp.json()["error"]["request_id"]
    assert requests.get(auth_app.http_url + "/auth/v1/models", timeout=30).status_code == 401
    resp = requests.post(url, json=body, headers={"Authorization": "Bearer k-http"}, timeout=120)
    assert resp.status_code == 200 and len(resp.content) == 2 * 2048 * 2
    assert requests.get(auth_app.http_url + "/auth/healthz", timeout=30).status_code == 200  # probes need no key


def test_per_key_request_rate_on_both_protocols(auth_app):
    codes = [grpc_call(auth_app, "ListModels", voxray_pb2.ListModelsRequest(), "k-rate-grpc") for _ in range(4)]
    assert [c[0] for c in codes[:3]] == [grpc.StatusCode.OK] * 3
    assert codes[3][0] == grpc.StatusCode.RESOURCE_EXHAUSTED and codes[3][2].get("retry-after-s")
    assert retry_delay_s(codes[3][2]) > 0  # google.rpc.RetryInfo in the status details
    headers = {"Authorization": "Bearer k-rate-http"}
    statuses = [requests.get(auth_app.http_url + "/auth/v1/models", headers=headers, timeout=30) for _ in range(4)]
    assert [r.status_code for r in statuses] == [200, 200, 200, 429] and int(statuses[3].headers["Retry-After"]) >= 1


def test_per_key_concurrent_streams(auth_app):
    meta = (("application", AUTH_APP), ("authorization", "Bearer k-streams"))
    with grpc.insecure_channel(auth_app.grpc_target) as channel:
        first = voxray_pb2_grpc.SpeechStub(channel).Synthesize(
            make_request("a long one", sampling={"max_tokens": 700}), metadata=meta
        )
        next(first)
        second = _run_stream_with_key(auth_app, "k-streams", "two", sampling={"max_tokens": 7})
        first.cancel()
    assert second.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "concurrent streams" in second.details


def test_http_client_gone_before_the_first_byte_gives_back_its_stream_slot(auth_app):
    """Two clients with the same key (1 stream) leave while their request is read, admitted or
    starting; the key's slot must come back, so a third request is served."""
    body = json.dumps({"input": "a long one", "sampling": {"max_tokens": 700}}).encode()
    parsed = urlparse(auth_app.http_url)
    for wait_s in (0.05, 0.2):
        conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
        headers = {"content-type": "application/json", "authorization": "Bearer k-gone"}
        conn.request("POST", "/auth/v1/audio/speech", body=body, headers=headers)
        time.sleep(wait_s)
        conn.sock.shutdown(2)
        conn.close()
    time.sleep(1.0)
    resp = requests.post(
        auth_app.http_url + "/auth/v1/audio/speech", json={"input": "next", "sampling": {"max_tokens": 7}},
        headers={"Authorization": "Bearer k-gone"}, timeout=120,
    )  # fmt: skip
    assert resp.status_code == 200, resp.text


# ---- malformed input from the wire --------------------------------------------------------

GRPC_WIRE = [
    (b"\xff\xff\xff\xff garbage", "request"),
    (voxray_pb2.SynthesizeRequest(text="hello").SerializeToString()[:-2], "request"),  # truncated
    (b"\x0a\x02\xff\xfe", "request"),  # invalid UTF-8
    (voxray_pb2.SynthesizeRequest(text="hi", format=7).SerializeToString(), "format"),
    (voxray_pb2.SynthesizeRequest(text="hi", ttfa_deadline_s=float("nan")).SerializeToString(), "ttfa_deadline_s"),
    (voxray_pb2.SynthesizeRequest(text="hi", ttfa_deadline_s=1e9).SerializeToString(), "ttfa_deadline_s"),
    (voxray_pb2.SynthesizeRequest(text="a\x00b").SerializeToString(), "text"),
    (voxray_pb2.SynthesizeRequest(text="hi", request_id="a\r\nb").SerializeToString(), "request_id"),
    (voxray_pb2.SynthesizeRequest(text="hi", request_id="r-€-1").SerializeToString(), "request_id"),
]


@pytest.mark.parametrize(("payload", "field"), GRPC_WIRE)
def test_grpc_malformed_wire_input_is_invalid_argument(cluster, payload, field):
    err = raw_synthesize(cluster["tight"], payload)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith(f"{field}:") and "(request id " in err.details()


HTTP_WIRE = [
    ({"data": b'{"input": "\\ud800"}'}, "input"),
    ({"json": {"input": "hi", "response_format": ["wav"]}}, "response_format"),
    ({"data": b"[" * 5000 + b"]" * 5000}, "body"),
    ({"data": b'{"input": "hi", "sampling": {"temperature": NaN}}'}, "body"),
    ({"json": {"input": "hi", "speed": True}}, "speed"),
    ({"json": {"input": "hi", "sampling": {"max_tokens": True}}}, "sampling.max_tokens"),
    ({"json": {"input": "hi", "stream": "yes"}}, "stream"),
    ({"json": {"input": "hi\x00"}}, "input"),
    ({"json": {"input": "hi", "request_id": "r-€-1"}}, "request_id"),
    ({"json": {"input": "hi", "request_id": "a\r\nb"}}, "request_id"),
    ({"json": {"input": "hi"}, "headers": {"X-Request-Id": "r-€-1".encode()}}, "X-Request-Id"),
    ({"json": {"input": "hi"}, "headers": [("X-Request-Id", "a"), ("X-Request-Id", "b")]}, "X-Request-Id"),
    ({"data": b"x" * 70_000}, "body"),
]


@pytest.mark.parametrize(("kwargs", "param"), HTTP_WIRE)
def test_http_malformed_input_is_400_naming_the_field(cluster, kwargs, param):
    url = cluster["tight"].http_url + "/v1/audio/speech"
    headers = kwargs.pop("headers", {})
    if "data" in kwargs:
        headers = {"content-type": "application/json", **dict(headers)}
    if isinstance(headers, list):  # repeated headers need the raw http.client API
        resp = _post_with_headers(url, kwargs["json"], headers)
    else:
        resp = requests.post(url, headers=headers, timeout=30, **kwargs)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == param, error
    assert error["request_id"] and error["message"].endswith(f"(request id {error['request_id']})")


def _post_with_headers(url: str, body: dict, headers: list[tuple[str, str]]) -> requests.Response:
    """POST with repeated headers (requests folds a dict), through http.client."""
    parsed = urlparse(url)
    payload = json.dumps(body).encode()
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    conn.putrequest("POST", parsed.path)
    for name, value in [("content-type", "application/json"), ("content-length", str(len(payload))), *headers]:
        conn.putheader(name, value)
    conn.endheaders(payload)
    reply = conn.getresponse()
    response = requests.Response()
    response.status_code, response._content = reply.status, reply.read()
    conn.close()
    return response


# ---- logs and leaks -----------------------------------------------------------------------


def serve_log_text() -> str:
    from ray._private.worker import _global_node

    logs = Path(_global_node.get_logs_dir_path()) / "serve"
    return "".join(path.read_text(errors="replace") for path in sorted(logs.glob("*.log")))


def test_client_errors_log_one_line_and_no_traceback(cluster):
    ep = cluster["tight"]
    before = serve_log_text().count("Traceback")
    ids = [f"quiet-{i}-{time.time_ns()}" for i in range(3)]
    for req_id in ids:
        outcome = run_stream(ep.grpc_target, ep.app_name, "", request_id=req_id)
        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    time.sleep(1.5)  # log files are flushed asynchronously
    text = serve_log_text()
    assert text.count("Traceback") == before
    for req_id in ids:
        assert sum(f"request {req_id}: INVALID_ARGUMENT" in line for line in text.splitlines()) == 1


def test_failed_requests_hold_no_stream_and_lock_no_one_out(cluster):
    """24 requests with a non-latin-1 id used to answer 500 after admission and keep their
    streams open forever, locking the server out. Now they are refused before admission."""
    ep = cluster["tight"]
    for i in range(30):
        resp = requests.post(
            ep.http_url + "/v1/audio/speech", json={"input": f"lock {i}", "request_id": f"r-€-{i}"}, timeout=30
        )
        assert resp.status_code == 400
    resp = requests.post(
        ep.http_url + "/v1/audio/speech", json={"input": "still served", "sampling": {"max_tokens": 14}}, timeout=120
    )
    assert resp.status_code == 200
    llm = serve.get_deployment_handle("LLMStage", ep.app_name).stats.remote().result()
    assert llm["kv_slots_used"] == 0 and llm["engine_requests"] == 0


def test_http_client_gone_mid_stream_frees_the_stream_within_1_s(cluster):
    ep = cluster["tight"]
    body = {"input": "a long one", "response_format": "pcm", "sampling": {"max_tokens": 1400}}
    with requests.post(ep.http_url + "/v1/audio/speech", json=body, stream=True, timeout=60) as resp:
        assert resp.status_code == 200
        next(resp.iter_content(4096))
        gone_at = time.time()
    llm_handle = serve.get_deployment_handle("LLMStage", ep.app_name)
    while time.time() - gone_at < 10:
        llm = llm_handle.stats.remote().result()
        if llm["kv_slots_used"] == 0 and llm["engine_requests"] == 0:
            break
        time.sleep(0.05)
    assert llm["kv_slots_used"] == 0 and llm["at_s"] - gone_at < 1.0

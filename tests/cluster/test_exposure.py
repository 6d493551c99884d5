"""`voxray serve` (what `make serve` runs) as a real subprocess with its own embedded Ray, on the default
config plus a test-time self-signed certificate: every socket of its process tree listens on loopback,
HTTP and gRPC answer over TLS and refuse plaintext, and /docs, /openapi.json and gRPC reflection are off."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import requests
import yaml
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.cli import main
from cluster.client import make_request
from core.config import ServeConfig
from protos import voxray_pb2, voxray_pb2_grpc
from tests.cluster.listening import Listener, listeners
from tests.tls_certs import CertPair, self_signed

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
_OFFSET = int(os.environ.get("VOXRAY_TEST_PORT_OFFSET", "0"))  # see tests/deployments/conftest.py
GRPC_PORT, HTTP_PORT = 19300 + _OFFSET, 19301 + _OFFSET
READY_TIMEOUT_S = 300.0
SPEECH_BODY = {"input": "hello", "response_format": "pcm", "sampling": {"max_tokens": 14}}


@dataclass
class Server:
    proc: subprocess.Popen
    certs: CertPair
    log: Path

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{GRPC_PORT}"

    @property
    def https_url(self) -> str:
        return f"https://127.0.0.1:{HTTP_PORT}"

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.certs.cert_pem)


def _list_models(server: Server) -> None:
    with grpc.secure_channel(server.grpc_target, server.credentials()) as channel:
        voxray_pb2_grpc.SpeechStub(channel).ListModels(voxray_pb2.ListModelsRequest(), timeout=5)


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"voxray serve exited {server.proc.returncode}:\n{server.log.read_text()[-3000:]}")
        try:
            _list_models(server)
            health = requests.get(server.https_url + "/healthz", verify=str(server.certs.cert_file), timeout=5)
            health.raise_for_status()
            return
        except (grpc.RpcError, requests.RequestException):
            time.sleep(1.0)
    pytest.fail(f"voxray serve not ready in {READY_TIMEOUT_S:.0f} s:\n{server.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("exposure")
    certs = self_signed(directory)
    tls = {"cert_file": certs.cert_file, "key_file": certs.key_file}
    config = ServeConfig(grpc_port=GRPC_PORT, http_port=HTTP_PORT, tls=tls)  # otherwise the embedded default
    config_file = directory / "serve.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    log = directory / "serve.log"
    command = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config_file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    running = Server(proc, certs, log)
    try:
        _wait_ready(running)
        yield running
    finally:
        proc.send_signal(signal.SIGINT)  # `voxray serve` returns; Ray shuts its processes down at exit
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started for it
            proc.wait(10)


def _describe(items: list[Listener]) -> str:
    return "\n".join(f"  {item.host}:{item.port}  pid {item.pid}  {item.command}" for item in items)


def test_every_socket_of_the_server_and_its_ray_listens_on_loopback(server):
    found = listeners(server.proc.pid)
    ports = {item.port for item in found}
    assert {GRPC_PORT, HTTP_PORT} <= ports, _describe(found)
    commands = " ".join(item.command for item in found)
    for process in ("gcs_server", "raylet", "ServeReplica", "ProxyActor", "DashboardAgent"):
        assert process in commands, f"no listener of {process} found:\n{_describe(found)}"
    print(f"{len(found)} listening sockets of `voxray serve` and its Ray:\n{_describe(found)}")  # pytest -s
    exposed = [item for item in found if not item.is_loopback]
    assert exposed == [], f"listening beyond loopback:\n{_describe(exposed)}\nall:\n{_describe(found)}"


def test_grpc_over_tls_streams_audio(server, tmp_path):
    with grpc.secure_channel(server.grpc_target, server.credentials()) as channel:
        chunks = list(voxray_pb2_grpc.SpeechStub(channel).Synthesize(make_request("hi", sampling={"max_tokens": 14})))
    assert chunks[-1].final and sum(len(c.audio) for c in chunks) > 0
    out = tmp_path / "say.wav"
    command = ["say", "hi", "-o", str(out), "--target", server.grpc_target, "--max-tokens", "14"]
    assert main([*command, "--tls-ca", str(server.certs.cert_file)]) == 0 and out.stat().st_size > 44


def test_https_streams_audio(server):
    url = server.https_url + "/v1/audio/speech"
    resp = requests.post(url, json=SPEECH_BODY, verify=str(server.certs.cert_file), timeout=120)
    assert resp.status_code == 200 and len(resp.content) > 0


def test_plaintext_to_the_tls_ports_fails(server):
    with grpc.insecure_channel(server.grpc_target) as channel, pytest.raises(grpc.RpcError) as caught:
        voxray_pb2_grpc.SpeechStub(channel).ListModels(voxray_pb2.ListModelsRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{HTTP_PORT}/healthz", timeout=10)


def test_docs_and_reflection_are_off_by_default(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        resp = requests.get(server.https_url + path, verify=str(server.certs.cert_file), timeout=30)
        assert resp.status_code == 404, path
    with grpc.secure_channel(server.grpc_target, server.credentials()) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED

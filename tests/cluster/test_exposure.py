"""`voxray serve` (what `make serve` runs) as a real subprocess with its own embedded Ray: on the embedded
default every socket of its process tree listens on loopback and /docs, /openapi.json and gRPC reflection
are off; with a test-time self-signed certificate HTTP and gRPC answer over TLS and refuse plaintext."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import requests
import yaml
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.cli import main
from cluster.client import make_request, open_channel
from core.config import ServeConfig
from protos import voxray_pb2, voxray_pb2_grpc
from tests.cluster.listening import Listener, listeners
from tests.tls_certs import CertPair, self_signed

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
_OFFSET = int(os.environ.get("VOXRAY_TEST_PORT_OFFSET", "0"))  # see tests/deployments/conftest.py
TLS_GRPC_PORT, TLS_HTTP_PORT, GRPC_PORT, HTTP_PORT = (p + _OFFSET for p in (19300, 19301, 19302, 19303))
READY_TIMEOUT_S = 300.0
SPEECH_BODY = {"input": "hello", "response_format": "pcm", "sampling": {"max_tokens": 14}}


@dataclass
class Server:
    proc: subprocess.Popen
    config: ServeConfig
    log: Path
    certs: CertPair | None = None

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.config.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{'https' if self.certs else 'http'}://127.0.0.1:{self.config.http_port}"

    @property
    def verify(self) -> str | bool:
        return str(self.certs.cert_file) if self.certs else True

    def channel(self) -> grpc.Channel:
        return open_channel(self.grpc_target, self.certs.cert_pem if self.certs else None)


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"voxray serve exited {server.proc.returncode}:\n{server.log.read_text()[-3000:]}")
        try:
            with server.channel() as channel:
                voxray_pb2_grpc.SpeechStub(channel).ListModels(voxray_pb2.ListModelsRequest(), timeout=5)
            requests.get(server.http_url + "/healthz", verify=server.verify, timeout=5).raise_for_status()
            return
        except (grpc.RpcError, requests.RequestException):
            time.sleep(1.0)
    pytest.fail(f"voxray serve not ready in {READY_TIMEOUT_S:.0f} s:\n{server.log.read_text()[-3000:]}")


@contextmanager
def voxray_serve(config: ServeConfig, directory: Path, certs: CertPair | None = None) -> Iterator[Server]:
    """`python -m cluster.cli serve --config` on `config`, ready; stopped (Ctrl-C) afterwards."""
    config_file = directory / "serve.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    log = directory / "serve.log"
    command = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config_file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = Server(proc, config, log, certs)
    try:
        _wait_ready(server)
        yield server
    finally:
        proc.send_signal(signal.SIGINT)  # `voxray serve` returns; Ray shuts its processes down at exit
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started for it
            proc.wait(10)


@pytest.fixture
def default_server(tmp_path):
    """The embedded default, only its ports moved (function scope: down before the TLS server starts)."""
    with voxray_serve(ServeConfig(grpc_port=GRPC_PORT, http_port=HTTP_PORT), tmp_path) as server:
        yield server


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    certs = self_signed(directory)
    tls = {"cert_file": certs.cert_file, "key_file": certs.key_file}
    config = ServeConfig(grpc_port=TLS_GRPC_PORT, http_port=TLS_HTTP_PORT, tls=tls)
    with voxray_serve(config, directory, certs) as server:
        yield server


def _describe(items: list[Listener]) -> str:
    """One line per socket; the command cut to 120 characters for reading (matching uses all of it)."""
    return "\n".join(f"  {item.host}:{item.port}  pid {item.pid}  {item.command[:120]}" for item in items)


def check_loopback_only(server: Server) -> None:
    found = listeners(server.proc.pid)
    print(f"{len(found)} listening sockets of `voxray serve` and its Ray:\n{_describe(found)}")  # pytest -s
    assert {server.config.grpc_port, server.config.http_port} <= {item.port for item in found}, _describe(found)
    commands = " ".join(item.command for item in found)
    for process in ("gcs_server", "raylet", "ServeReplica", "ProxyActor", "DashboardAgent"):
        assert process in commands, f"no listener of {process} found:\n{_describe(found)}"
    exposed = [item for item in found if not item.is_loopback]
    assert exposed == [], f"listening beyond loopback:\n{_describe(exposed)}\nall:\n{_describe(found)}"


def check_docs_and_reflection_off(server: Server) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert requests.get(server.http_url + path, verify=server.verify, timeout=30).status_code == 404, path
    with server.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_the_embedded_default_listens_on_loopback_only_and_shows_no_docs(default_server):
    check_loopback_only(default_server)
    check_docs_and_reflection_off(default_server)
    with default_server.channel() as channel:
        chunks = list(voxray_pb2_grpc.SpeechStub(channel).Synthesize(make_request("hi", sampling={"max_tokens": 7})))
    assert chunks[-1].final


def test_with_tls_too_everything_listens_on_loopback_only(tls_server):
    check_loopback_only(tls_server)
    check_docs_and_reflection_off(tls_server)


def test_grpc_over_tls_streams_audio(tls_server, tmp_path):
    with tls_server.channel() as channel:
        chunks = list(voxray_pb2_grpc.SpeechStub(channel).Synthesize(make_request("hi", sampling={"max_tokens": 14})))
    assert chunks[-1].final and sum(len(c.audio) for c in chunks) > 0
    out = tmp_path / "say.wav"
    command = ["say", "hi", "-o", str(out), "--target", tls_server.grpc_target, "--max-tokens", "14"]
    assert main([*command, "--tls-ca", str(tls_server.certs.cert_file)]) == 0 and out.stat().st_size > 44


def test_https_streams_audio(tls_server):
    resp = requests.post(tls_server.http_url + "/v1/audio/speech", json=SPEECH_BODY, verify=tls_server.verify,
                         timeout=120)  # fmt: skip
    assert resp.status_code == 200 and len(resp.content) > 0


def test_plaintext_to_the_tls_ports_fails(tls_server):
    with grpc.insecure_channel(tls_server.grpc_target) as channel, pytest.raises(grpc.RpcError) as caught:
        voxray_pb2_grpc.SpeechStub(channel).ListModels(voxray_pb2.ListModelsRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{TLS_HTTP_PORT}/healthz", timeout=10)

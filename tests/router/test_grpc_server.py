"""The Router's own gRPC server (`router.grpc_server`) around a stand-in for the Router's methods:
raw request bytes in, the Router's status / details / trailers out natively, the client's deadline
visible, `application` routing, reflection and TLS only when configured, SO_REUSEPORT."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from core.config import ServeConfig
from protos import voxray_pb2
from router.grpc_server import SERVICE_NAME, SpeechServer
from router.ingress import _abort
from tests.deployments.grpc_helpers import retry_delay_s
from tests.tls_certs import self_signed

SYNTHESIZE = f"/{SERVICE_NAME}/Synthesize"
LIST_MODELS = f"/{SERVICE_NAME}/ListModels"


class StandInRouter:
    """The Router's gRPC methods as the server calls them; records what reached them."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.remaining_s: list[float | None] = []

    async def Synthesize(self, request: bytes, grpc_context):  # noqa: N802
        self.requests.append(request)
        self.remaining_s.append(grpc_context.time_remaining())
        if request == b"full":
            _abort(grpc_context, grpc.StatusCode.RESOURCE_EXHAUSTED, "at capacity (request id r-1)", 1.5, "r-1")
        for seq in range(2):
            yield voxray_pb2.AudioChunk(request_id="r-1", seq=seq, audio=request)

    async def SynthesizeStream(self, requests, grpc_context):  # noqa: N802
        seq = 0
        async for request in requests:  # echo each raw message back as it arrives
            self.requests.append(request)
            yield voxray_pb2.AudioChunk(request_id="r-1", seq=seq, audio=request)
            seq += 1

    async def Converse(self, requests, grpc_context):  # noqa: N802
        async for request in requests:  # the pieces' sizes, once the turn ends
            self.requests.append(request)
        yield voxray_pb2.AudioChunk(request_id="r-1", text=",".join(str(len(r)) for r in self.requests))

    async def Transcribe(self, request: bytes, grpc_context):  # noqa: N802
        self.requests.append(request)
        if request == b"bad":
            _abort(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, "audio.data: is silent", None, "r-2")
        return voxray_pb2.TranscribeResponse(text=f"{len(request)} bytes", request_id="r-2")

    async def ListModels(self, request: bytes, grpc_context):  # noqa: N802
        return voxray_pb2.ListModelsResponse(models=[voxray_pb2.ModelInfo(name="orpheus-tiny")])

    async def ListVoices(self, request: bytes, grpc_context):  # noqa: N802
        return voxray_pb2.ListVoicesResponse()

    async def RegisterVoice(self, request: bytes, grpc_context):  # noqa: N802
        return voxray_pb2.RegisterVoiceResponse()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serving(configs: list[ServeConfig], methods: StandInRouter) -> Iterator[list[SpeechServer]]:
    """SpeechServers for `configs` on an event loop of their own (as in a replica)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start(config: ServeConfig) -> SpeechServer:
        server = SpeechServer(config, methods)
        await server.start()
        return server

    servers = [asyncio.run_coroutine_threadsafe(start(c), loop).result(10) for c in configs]
    try:
        yield servers
    finally:
        for server in servers:
            asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _stream(channel: grpc.Channel, payload: bytes, metadata=(), timeout: float = 10) -> list:
    call = channel.unary_stream(
        SYNTHESIZE, request_serializer=None, response_deserializer=voxray_pb2.AudioChunk.FromString
    )
    return list(call(payload, metadata=metadata, timeout=timeout))


@pytest.fixture
def config() -> ServeConfig:
    return ServeConfig(grpc_port=free_port())


def test_raw_bytes_reach_the_router_and_chunks_stream_back(config):
    router = StandInRouter()
    with serving([config], router), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        chunks = _stream(channel, b"\xff\x00garbage", timeout=7)
    assert router.requests == [b"\xff\x00garbage"]  # no deserializer: the Router's validator sees the bytes
    assert [c.seq for c in chunks] == [0, 1] and chunks[0].audio == b"\xff\x00garbage"
    # the client's deadline is visible to the Router (gRPC's timeout header rounds it up: 7.009 s was seen)
    assert 0 < router.remaining_s[0] <= 7.1


def test_bidi_messages_reach_the_router_raw_and_in_order_while_chunks_stream_back(config):
    router = StandInRouter()
    with serving([config], router), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        call = channel.stream_stream(
            "/voxray.Speech/SynthesizeStream", request_serializer=None,
            response_deserializer=voxray_pb2.AudioChunk.FromString,
        )  # fmt: skip
        chunks = list(call(iter([b"one", b"\xff two", b"three"]), timeout=10))
    assert router.requests == [b"one", b"\xff two", b"three"]
    assert [c.audio for c in chunks] == router.requests and [c.seq for c in chunks] == [0, 1, 2]


def test_converse_is_served_bidi_raw(config):
    router = StandInRouter()
    with serving([config], router), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        call = channel.stream_stream(
            "/voxray.Speech/Converse", request_serializer=None, response_deserializer=voxray_pb2.AudioChunk.FromString
        )
        chunks = list(call(iter([b"cfg", b"\x01\x02" * 8, b"end"]), timeout=10))
    assert router.requests == [b"cfg", b"\x01\x02" * 8, b"end"] and [c.text for c in chunks] == ["3,16,3"]


def test_transcribe_is_served_unary_raw(config):
    router = StandInRouter()
    with serving([config], router), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        call = channel.unary_unary(
            f"/{SERVICE_NAME}/Transcribe", request_serializer=None,
            response_deserializer=voxray_pb2.TranscribeResponse.FromString,
        )  # fmt: skip
        response = call(b"\x0a\x02\xff\xfe", timeout=10)  # not a valid message: it reaches the Router as sent
        with pytest.raises(grpc.RpcError) as caught:
            call(b"bad", timeout=10)
    assert router.requests == [b"\x0a\x02\xff\xfe", b"bad"] and response.text == "4 bytes"
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith("audio.data")
    assert dict(caught.value.trailing_metadata())["x-request-id"] == "r-2"


def test_router_status_details_and_trailers_reach_the_client_natively(config):
    with serving([config], StandInRouter()), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as caught:
            _stream(channel, b"full")
    err = caught.value
    trailers = dict(err.trailing_metadata())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details() == "at capacity (request id r-1)"
    assert trailers["x-request-id"] == "r-1" and trailers["retry-after-ms"] == "1500"
    assert retry_delay_s(trailers) == 1.5


def test_application_metadata_naming_another_app_is_not_found(config):
    with serving([config], StandInRouter()), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        assert len(_stream(channel, b"a", metadata=(("application", "voxray"),))) == 2
        assert len(_stream(channel, b"a")) == 2  # the key is optional: the port names the app
        with pytest.raises(grpc.RpcError) as caught:
            _stream(channel, b"a", metadata=(("application", "other"),))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "'other'" in caught.value.details()


def _reflected_services(target: str) -> list[str]:
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        [reply] = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    return [service.name for service in reply.list_services_response.service]


def test_reflection_only_when_configured(config):
    with serving([config], StandInRouter()):
        with pytest.raises(grpc.RpcError) as caught:
            _reflected_services(f"127.0.0.1:{config.grpc_port}")
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    on = config.model_copy(update={"grpc_reflection": True, "grpc_port": free_port()})
    with serving([on], StandInRouter()):
        assert SERVICE_NAME in _reflected_services(f"127.0.0.1:{on.grpc_port}")


def test_tls_when_configured_and_plaintext_to_the_tls_port_fails(tmp_path):
    pair = self_signed(tmp_path)
    config = ServeConfig(grpc_port=free_port(), tls={"cert_file": pair.cert_file, "key_file": pair.key_file})
    target = f"127.0.0.1:{config.grpc_port}"
    with serving([config], StandInRouter()):
        with grpc.secure_channel(target, grpc.ssl_channel_credentials(pair.cert_pem)) as channel:
            assert len(_stream(channel, b"a")) == 2
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as caught:
            _stream(channel, b"a", timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_router_replicas_on_one_node_share_the_port(config):
    router = StandInRouter()
    with serving([config, config], router), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        assert len(_stream(channel, b"a")) == 2


def test_a_port_taken_without_reuseport_fails_loudly(config):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", config.grpc_port))
        taken.listen()
        with pytest.raises(RuntimeError):
            with serving([config], StandInRouter()):
                pass

"""The Router replica's own gRPC server for `voxray.Speech` (Serve's gRPC proxy is not started).

`SpeechServer` runs a `grpc.aio` server on the replica's event loop, bound to the config's
`grpc_host:grpc_port` with SO_REUSEPORT (the Router replicas of one node share the port and the
kernel spreads connections over them), TLS server credentials when `tls` is configured, and
server reflection only when `grpc_reflection` is on. Requests reach the Router's methods as raw
bytes (no deserializer), so garbage, truncated or non-UTF-8 protobuf gets INVALID_ARGUMENT naming
`request` from `router.jobs`. The Router sets the status, details and trailers (`x-request-id`,
`retry-after-ms`, `grpc-status-details-bin`) on the call's own context and raises `GrpcAbort`,
which ends the call with them; the client's deadline is on the same context.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Protocol

import grpc
from google.protobuf.message import Message

from core.config import ServeConfig
from protos import voxray_pb2

logger = logging.getLogger("ray.serve.voxray")
SERVICE_NAME = "voxray.Speech"
GRACE_S = 5.0  # streams still running when the server stops get this long to finish


class GrpcAbort(Exception):
    """Raised by a Router gRPC method after it set the status on the context and logged the failure."""


class SpeechMethods(Protocol):
    """What the Router offers the server: its gRPC methods, taking raw request bytes and the context."""

    def Synthesize(self, request: bytes, grpc_context) -> AsyncIterator[Message]: ...  # noqa: N802

    def SynthesizeStream(self, requests: AsyncIterator[bytes], grpc_context) -> AsyncIterator[Message]: ...  # noqa: N802

    def Converse(self, requests: AsyncIterator[bytes], grpc_context) -> AsyncIterator[Message]: ...  # noqa: N802

    def Transcribe(self, request: bytes, grpc_context) -> Awaitable[Message]: ...  # noqa: N802

    def ListModels(self, request: bytes, grpc_context) -> Awaitable[Message]: ...  # noqa: N802

    def ListVoices(self, request: bytes, grpc_context) -> Awaitable[Message]: ...  # noqa: N802

    def RegisterVoice(self, request: bytes, grpc_context) -> Awaitable[Message]: ...  # noqa: N802


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


async def _routed_here(context: grpc.aio.ServicerContext, app_name: str) -> bool:
    """False (NOT_FOUND set) for a client naming another app in its `application` metadata (an app
    is addressed by its port here; the key stays optional for clients written for Serve's proxy)."""
    names = [v for k, v in context.invocation_metadata() or () if k == "application"]
    if not names or names == [app_name]:
        return True
    context.set_code(grpc.StatusCode.NOT_FOUND)
    context.set_details(f"application {names[0][:64]!r} is not served on this port; this is {app_name!r}")
    return False


def _stream_handler(method: Callable[..., AsyncIterator[Message]], app_name: str) -> grpc.RpcMethodHandler:
    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        if not await _routed_here(context, app_name):
            return
        try:
            async with aclosing(method(request, context)) as messages:  # closed with the call (client gone)
                async for message in messages:
                    yield message
        except GrpcAbort:
            return  # status, details and trailers are on the context

    return grpc.unary_stream_rpc_method_handler(handle, request_deserializer=None, response_serializer=_serialize)


def _bidi_handler(method: Callable[..., AsyncIterator[Message]], app_name: str) -> grpc.RpcMethodHandler:
    async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        if not await _routed_here(context, app_name):
            return
        try:
            async with aclosing(method(requests, context)) as messages:
                async for message in messages:
                    yield message
        except GrpcAbort:
            return

    return grpc.stream_stream_rpc_method_handler(handle, request_deserializer=None, response_serializer=_serialize)


def _unary_handler(method: Callable[..., Awaitable[Message]], app_name: str) -> grpc.RpcMethodHandler:
    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> Message | None:
        if not await _routed_here(context, app_name):
            return None
        try:
            return await method(request, context)
        except GrpcAbort:
            return None

    return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=None, response_serializer=_serialize)


def speech_handler(methods: SpeechMethods, app_name: str) -> grpc.GenericRpcHandler:
    """`voxray.Speech` served by `methods` (the Router), raw-bytes requests."""
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Synthesize": _stream_handler(methods.Synthesize, app_name),
            "SynthesizeStream": _bidi_handler(methods.SynthesizeStream, app_name),
            "Converse": _bidi_handler(methods.Converse, app_name),
            "Transcribe": _unary_handler(methods.Transcribe, app_name),
            "ListModels": _unary_handler(methods.ListModels, app_name),
            "ListVoices": _unary_handler(methods.ListVoices, app_name),
            "RegisterVoice": _unary_handler(methods.RegisterVoice, app_name),
        },
    )


def listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def server_credentials(config: ServeConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured cert / key files (None: plaintext)."""
    tls = config.tls
    if not tls.enabled:
        return None
    return grpc.ssl_server_credentials([(tls.key_file.read_bytes(), tls.cert_file.read_bytes())])


class SpeechServer:
    """One Router replica's gRPC server; `start` on the replica's loop, `stop` when it shuts down."""

    def __init__(self, config: ServeConfig, methods: SpeechMethods) -> None:
        self.address = listen_address(config.grpc_host, config.grpc_port)
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
        self.server.add_generic_rpc_handlers((speech_handler(methods, config.app_name),))
        if config.grpc_reflection:
            from grpc_reflection.v1alpha import reflection

            names = (voxray_pb2.DESCRIPTOR.services_by_name["Speech"].full_name, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self.server)
        credentials = server_credentials(config)
        if credentials is None:
            self.port = self.server.add_insecure_port(self.address)
        else:
            self.port = self.server.add_secure_port(self.address, credentials)
        self.is_tls = credentials is not None

    async def start(self) -> None:
        await self.server.start()
        logger.info("gRPC %s listening on %s (%s)", SERVICE_NAME, self.address, "TLS" if self.is_tls else "plaintext")

    async def stop(self, grace_s: float = GRACE_S) -> None:
        await self.server.stop(grace_s)

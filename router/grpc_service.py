"""The `voxray.Speech` service as Serve's gRPC proxy registers it, and the proxy's error logging.

Serve's proxy parses each request with the servicer function's request deserializer before any
code of ours runs; with the generated `SynthesizeRequest.FromString` a garbage, truncated or
non-UTF-8 message fails inside grpcio and the client gets UNKNOWN ("Unexpected DecodeError").
`add_speech_servicer` (the servicer function named in the Serve config) registers the same
methods with no deserializer, so the proxy forwards the raw bytes and the Router parses them
(`router.jobs.parse_proto`: INVALID_ARGUMENT naming `request`).

Serve sends a status only for a call that raises, carries only its code and details from the
replica to the proxy (trailing metadata set on the replica's context is lost), and logs the
exception with its traceback twice (replica and proxy). `pack_trailers` folds the trailers into
the details after a record separator; the proxy-side wrapper that `add_speech_servicer`
installs splits them off again as real trailing metadata (`-bin` values base64 on the way).
The Router logs each failure itself (one line for a client error, the traceback once for its
own) and raises `GrpcAbort`; `QuietAborts`, installed in the replica and (by
`add_speech_servicer`) in every proxy, drops Serve's duplicate records of it.
"""

from __future__ import annotations

import base64
import json
import logging
from contextlib import aclosing

import grpc

from protos import voxray_pb2_grpc

SERVE_LOGGER = "ray.serve"
logger = logging.getLogger("ray.serve.voxray")
TRAILERS_SEPARATOR = "\x1e"  # ASCII record separator: never in a message we write
SPEECH_SERVICER = "router.grpc_service.add_speech_servicer"  # the Serve config's grpc_servicer_functions entry


class GrpcAbort(Exception):
    """Raised by a Router gRPC method after it set the status on the context and logged the failure."""


class QuietAborts(logging.Filter):
    """Drops Serve's records of a GrpcAbort (raw, or wrapped in Serve's gRPCStatusError), and the
    traceback from its one line for a stream the client left (GeneratorExit in the proxy)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, GeneratorExit):
            record.exc_info, record.exc_text = None, None
            record.msg = f"{record.msg} (client went away)"
            return True
        original = getattr(exc, "original_exception", exc)
        return not isinstance(original, GrpcAbort)


def quiet_serve_aborts() -> None:
    """Install QuietAborts on Serve's logger in this process (once)."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, QuietAborts) for f in serve_logger.filters):
        serve_logger.addFilter(QuietAborts())


def pack_trailers(details: str, trailers: list[tuple[str, str | bytes]]) -> str:
    """Status details carrying `trailers` through Serve to the proxy (replica side)."""
    if not trailers:
        return details
    encoded = [(k, base64.b64encode(v).decode() if k.endswith("-bin") else v) for k, v in trailers]
    return details + TRAILERS_SEPARATOR + json.dumps(encoded)


def unpack_trailers(context) -> None:
    """Move trailers packed into the status details onto the call's trailing metadata (proxy side)."""
    details = context.details() or ""
    if isinstance(details, bytes):
        details = details.decode("utf-8", "replace")
    if TRAILERS_SEPARATOR not in details:
        return
    message, _, blob = details.partition(TRAILERS_SEPARATOR)
    context.set_details(message)
    try:
        pairs = json.loads(blob)
        context.set_trailing_metadata(tuple((k, base64.b64decode(v) if k.endswith("-bin") else v) for k, v in pairs))
    except (ValueError, TypeError):
        logger.warning("dropped malformed packed trailers")


def _with_trailers(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """Serve's proxy behaviours for one method, followed by `unpack_trailers`."""
    unary_stream, unary_unary = handler.unary_stream, handler.unary_unary

    async def stream_then_unpack(request, context):
        async with aclosing(unary_stream(request, context)) as messages:  # closed with this one (client gone)
            async for message in messages:
                yield message
        unpack_trailers(context)

    async def call_then_unpack(request, context):
        response = await unary_unary(request, context)
        unpack_trailers(context)
        return response

    return handler._replace(unary_stream=stream_then_unpack, unary_unary=call_then_unpack)


def _raw_request(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    return handler._replace(request_deserializer=None)


class _RawRequestServer:
    """Passes the generated servicer's handlers to Serve's server without their request
    deserializers, then wraps the behaviours Serve installed with `unpack_trailers`. Only the
    generic-handler path is registered (grpcio looks its handlers up per call, so the wrapped
    ones serve); Serve keeps it as the path for grpcio without registered methods."""

    def __init__(self, server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        for handler in handlers:
            handler._method_handlers = {name: _raw_request(h) for name, h in handler._method_handlers.items()}
        self.server.add_generic_rpc_handlers(handlers)  # Serve swaps in its proxy behaviours here
        for handler in handlers:
            handler._method_handlers = {name: _with_trailers(h) for name, h in handler._method_handlers.items()}

    def add_registered_method_handlers(self, service_name: str, handlers: dict) -> None:
        """Not registered: a registered handler would bypass the wrapped generic ones."""


def add_speech_servicer(servicer, server) -> None:
    """Serve's `grpc_servicer_functions` entry: `voxray.Speech` with raw-bytes requests."""
    quiet_serve_aborts()
    voxray_pb2_grpc.add_SpeechServicer_to_server(servicer, _RawRequestServer(server))

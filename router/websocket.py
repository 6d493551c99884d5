"""The incremental-text WebSocket (`/v1/audio/speech/stream` on the HTTP port): a config message,
then JSON text / flush / end messages in; per audio chunk a JSON description and one binary
message out; errors name the field, then close with a documented code. It drives an
`IncrementalSession`; README ("Incremental text") documents the messages and close codes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, suppress
from dataclasses import dataclass

import grpc
from starlette.websockets import WebSocket, WebSocketDisconnect

from core.errors import InvalidArgumentError
from core.messages import Job
from llm_stage.jobs import printable_name
from router.audio_format import streaming_wav_header
from router.incremental import IdleTimeout, IncrementalSession
from router.jobs import MAX_BODY_BYTES, OPENAI_FORMATS, parse_json_object
from router.replies import Failure, log_failure, with_request_id

CONFIG_FIELDS = frozenset({"model", "voice", "sampling", "response_format", "ttfa_deadline_s", "request_id"})
INPUT_FIELDS = frozenset({"text", "flush", "end"})
CLOSE_BAD_MESSAGE = 1008
CLOSE_UNSUPPORTED = 1003
CLOSE_IDLE = 4408
CLOSE_TRY_LATER = 1013
CLOSE_INTERNAL = 1011
CLOSE_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: CLOSE_BAD_MESSAGE,
    grpc.StatusCode.UNAUTHENTICATED: CLOSE_BAD_MESSAGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CLOSE_TRY_LATER,
    grpc.StatusCode.UNAVAILABLE: CLOSE_TRY_LATER,
    grpc.StatusCode.DEADLINE_EXCEEDED: CLOSE_IDLE,
}
FailureOf = Callable[[Exception], tuple[Failure, Exception | None]]  # the Router's reply for an exception
PLACEHOLDER_TEXT = "-"  # the config's template Job carries no text; each segment brings its own


class BinaryMessage(Exception):
    """The client sent a binary message; this endpoint takes JSON text only."""


@dataclass(frozen=True)
class StreamInput:
    """One input message after the config."""

    text: str | None
    flush: bool
    end: bool


def config_fields(obj: dict) -> dict:
    """`job_from_fields` keyword arguments from the config message (strict, names the field)."""
    if INPUT_FIELDS & set(obj):
        field = sorted(INPUT_FIELDS & set(obj))[0]
        raise InvalidArgumentError(field, "send the config message first")
    unknown = set(obj) - CONFIG_FIELDS
    if unknown:
        raise InvalidArgumentError(printable_name(sorted(unknown)[0]), "unknown field")
    fmt = obj.get("response_format", "pcm")
    if not isinstance(fmt, str) or fmt not in OPENAI_FORMATS:
        raise InvalidArgumentError("response_format", "must be one of: pcm, wav")
    strings = {name: obj.get(name, "") for name in ("model", "voice", "request_id")}
    for name, value in strings.items():
        if not isinstance(value, str):
            raise InvalidArgumentError(name, "must be a string")
    if not isinstance(obj.get("sampling", {}), dict):
        raise InvalidArgumentError("sampling", "must be an object of sampling fields")
    return {
        "text": PLACEHOLDER_TEXT, "model": strings["model"], "voice": strings["voice"],
        "sampling": obj.get("sampling", {}), "output_format": OPENAI_FORMATS[fmt], "sample_rate_hz": 0,
        "ttfa_deadline_s": obj.get("ttfa_deadline_s", 0.0), "req_id": strings["request_id"],
    }  # fmt: skip


def stream_input(obj: dict) -> StreamInput:
    """An input message: text and / or flush / end; config fields again are refused by name."""
    again = set(obj) & CONFIG_FIELDS
    if again:
        raise InvalidArgumentError(sorted(again)[0], "the stream is already configured (config is the first message)")
    unknown = set(obj) - INPUT_FIELDS
    if unknown:
        raise InvalidArgumentError(printable_name(sorted(unknown)[0]), "unknown field")
    if not obj:
        raise InvalidArgumentError("text", "an input message needs text, flush or end")
    for flag in ("flush", "end"):
        if flag in obj and obj[flag] is not True:
            raise InvalidArgumentError(flag, "must be true when given")
    return StreamInput(obj.get("text"), "flush" in obj, "end" in obj)


async def receive_object(websocket: WebSocket) -> dict:
    """The next JSON object the client sent (raises WebSocketDisconnect when it left)."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    if message.get("text") is None:
        raise BinaryMessage
    text = message["text"]
    if len(text) > MAX_BODY_BYTES:
        raise InvalidArgumentError("message", f"larger than {MAX_BODY_BYTES} characters")
    return parse_json_object(text.encode("utf-8", "surrogatepass"))


def apply(session: IncrementalSession, item: StreamInput) -> None:
    if item.text is not None:
        session.push(item.text)
    if item.flush:
        session.flush()
    if item.end:
        session.end()


async def read_inputs(websocket: WebSocket, session: IncrementalSession) -> None:
    """Feed the client's messages to the session; after its end keep listening, so a client that
    leaves while its audio is still being made cancels the stream (and a late message is refused)."""
    while True:
        apply(session, stream_input(await receive_object(websocket)))


async def send_audio(websocket: WebSocket, session: IncrementalSession, header: bytes) -> float:
    """Every chunk as a JSON description and a binary message; returns the seconds of audio sent."""
    audio_s = 0.0
    async for part in session.audio():
        audio = part.audio
        if audio.is_final and not audio.pcm16:
            break
        data = (header if audio.seq == 0 else b"") + audio.pcm16
        meta = {
            "type": "audio", "seq": audio.seq, "segment": part.segment_index, "segment_end": part.is_segment_end,
            "num_bytes": len(data), "duration_s": round(audio.duration_s, 6),
        }  # fmt: skip
        if part.segment_text:
            meta["text"] = part.segment_text
        await websocket.send_text(json.dumps(meta))
        await websocket.send_bytes(data)
        audio_s += audio.duration_s
    return audio_s


@dataclass
class StreamEndpoint:
    """What the Router gives the endpoint: how to check the key, build the config's template Job,
    open a session (admission, counted as one stream for its life), the WAV header, and how a
    failure maps to a status."""

    authorize: Callable[[WebSocket], AbstractAsyncContextManager[None]]
    template: Callable[[dict], Job]
    open_session: Callable[[Job], AbstractAsyncContextManager[IncrementalSession]]
    wav_header: bytes | None  # None: the session's model's (a multi-model Router picks it by the config's model)
    failure_of: FailureOf

    async def serve(self, websocket: WebSocket, fallback_req_id: str) -> None:
        await websocket.accept()
        req_id = fallback_req_id
        try:
            async with self.authorize(websocket):
                job = self.template(config_fields(await receive_object(websocket)))
                req_id = job.req_id
                async with self.open_session(job) as session:
                    ready = {"type": "ready", "request_id": job.req_id, "sample_rate_hz": session.sample_rate_hz}
                    await websocket.send_text(json.dumps(ready))
                    audio_s = await self._run(websocket, session, job)
            await websocket.send_text(json.dumps({"type": "done", "audio_s": round(audio_s, 6)}))
            await websocket.close(1000)
        except WebSocketDisconnect:
            return  # the client left: the session's stream was cancelled on the way out
        except Exception as err:
            await send_failure(websocket, err, req_id, self.failure_of)

    async def _run(self, websocket: WebSocket, session: IncrementalSession, job: Job) -> float:
        """Read input and send audio at once; the first to fail cancels the other (a client that
        left, or a bad message, ends the synthesis too)."""
        wav_header = self.wav_header if self.wav_header is not None else streaming_wav_header(session.sample_rate_hz)
        header = wav_header if job.output_format == "wav" else b""
        reader = asyncio.ensure_future(read_inputs(websocket, session))
        writer = asyncio.ensure_future(send_audio(websocket, session, header))
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer in done:
                return writer.result()
            raise reader.exception()  # the reader only ever ends by failing (or the client leaving)
        finally:
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)


async def send_failure(websocket: WebSocket, err: Exception, req_id: str, failure_of: FailureOf) -> None:
    """The error message (code, field, message, request id, retry hint) and the close code for `err`."""
    if isinstance(err, BinaryMessage):
        failure = Failure(grpc.StatusCode.INVALID_ARGUMENT, "binary messages are not accepted; send JSON text")
        close_code = CLOSE_UNSUPPORTED
    elif isinstance(err, IdleTimeout):
        failure, close_code = Failure(grpc.StatusCode.DEADLINE_EXCEEDED, str(err)), CLOSE_IDLE
    else:
        failure, own = failure_of(err)
        log_failure(failure, req_id, "WebSocket", own)
        close_code = CLOSE_CODES.get(failure.code, CLOSE_INTERNAL)
    body = {
        "type": "error", "code": failure.code.name, "param": failure.param,
        "message": with_request_id(failure.message, req_id), "request_id": req_id,
    }  # fmt: skip
    if failure.retry_after_s is not None:
        body["retry_after_s"] = failure.retry_after_s
    with suppress(Exception):  # the client may be gone already
        await websocket.send_text(json.dumps(body))
        await websocket.close(close_code)

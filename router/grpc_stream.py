"""The gRPC bidi `SynthesizeStream` (voice agents): the first message configures an
incremental-text stream, the next ones carry text pieces, flush and end (the client's half-close
ends it too); AudioChunks come back as from `Synthesize`. It drives the same `IncrementalSession`
as the WebSocket (`router.websocket`); the Router's method wires in auth, admission and errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from core.errors import InvalidArgumentError
from protos import voxray_pb2
from router.incremental import IncrementalSession
from router.jobs import fields_from_proto, parse_proto

PLACEHOLDER_TEXT = "-"  # the config's template Job needs text to validate; each segment brings its own


def _request(raw: bytes) -> voxray_pb2.SynthesizeStreamRequest:
    message = parse_proto(voxray_pb2.SynthesizeStreamRequest, raw)
    if message.WhichOneof("input") is None:
        raise InvalidArgumentError("input", "empty message: set one of config, text, flush, end")
    return message


async def read_config(requests: AsyncIterator[bytes]) -> tuple[dict, str]:
    """The first message's `job_from_fields` keyword arguments (text replaced by a placeholder) and
    its text, the stream's first piece."""
    try:
        first = _request(await anext(requests))
    except StopAsyncIteration:
        raise InvalidArgumentError("config", "the stream ended before its config message") from None
    if first.WhichOneof("input") != "config":
        raise InvalidArgumentError("config", f"the first message must be config, got {first.WhichOneof('input')}")
    fields = fields_from_proto(first.config)
    if fields["input_audio"] is not None:
        raise InvalidArgumentError("config.input_audio", "streamed text takes no audio; send it with Synthesize")
    if fields["text_only"]:
        raise InvalidArgumentError("config.text_only", "streamed text is spoken; answer in text with Synthesize")
    return {**fields, "text": PLACEHOLDER_TEXT}, fields["text"]


def apply(session: IncrementalSession, message: voxray_pb2.SynthesizeStreamRequest) -> None:
    match message.WhichOneof("input"):
        case "config":
            raise InvalidArgumentError("config", "given twice: only the first message configures the stream")
        case "text":
            session.push(message.text)
        case "flush":
            if message.flush:
                session.flush()
        case "end":
            if message.end:
                session.end()


async def read_inputs(requests: AsyncIterator[bytes], session: IncrementalSession) -> None:
    """Feed the client's messages to the session; its half-close ends the text."""
    async for raw in requests:
        apply(session, _request(raw))
    session.end()
    await asyncio.Event().wait()  # the audio side ends the call; a reader that returned would look like a failure


def to_proto(req_id: str, part, header: bytes) -> voxray_pb2.AudioChunk:
    audio = part.audio
    return voxray_pb2.AudioChunk(
        request_id=req_id, seq=audio.seq, audio=(header if audio.seq == 0 else b"") + audio.pcm16,
        sample_rate_hz=audio.sample_rate_hz, duration_s=audio.duration_s, final=audio.is_final,
    )  # fmt: skip


async def stream_audio(
    requests: AsyncIterator[bytes], session: IncrementalSession, req_id: str, header: bytes
) -> AsyncIterator[voxray_pb2.AudioChunk]:
    """The session's audio while its input is read; a bad message (or the reader failing) ends it."""
    reader = asyncio.ensure_future(read_inputs(requests, session))
    audio = session.audio()
    part: asyncio.Future | None = None
    try:
        while True:
            part = asyncio.ensure_future(anext(audio))
            done, _ = await asyncio.wait({reader, part}, return_when=asyncio.FIRST_COMPLETED)
            if part not in done:
                raise reader.exception()  # the reader only ends by failing
            try:
                chunk = part.result()
            except StopAsyncIteration:
                return
            yield to_proto(req_id, chunk, header)
            if chunk.audio.is_final:
                return
    finally:
        pending = [task for task in (reader, part) if task is not None and not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # the audio generator is idle before closing it
        await audio.aclose()

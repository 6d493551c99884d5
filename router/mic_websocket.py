"""The microphone WebSocket (`/v1/audio/converse` on the HTTP port): a JSON config message, then
binary PCM16 frames of the user's audio and a JSON `{"end_of_turn": true}`; out: `ready`, the
answer's text as `text` messages as it is decoded, per audio chunk a JSON description and one binary
message, then `done` and a close with 1000. One turn per socket. Errors name the field and close
with the codes of the incremental-text WebSocket (`router.websocket`); README ("Streamed microphone
input") documents the messages. The audio is fed to a `MicTurn` as it comes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, aclosing
from dataclasses import dataclass

from starlette.websockets import WebSocket, WebSocketDisconnect

from core.errors import InvalidArgumentError
from llm_stage.jobs import printable_name
from router.audio_format import streaming_wav_header
from router.incremental import IdleTimeout
from router.jobs import MAX_BODY_BYTES, OPENAI_FORMATS, parse_json_object
from router.mic_turn import MicFields, MicTurn, check_rate, turn_job
from router.streams import RouterCore, SentChunk
from router.websocket import FailureOf, send_failure

CONFIG_FIELDS = frozenset({"model", "voice", "sampling", "response_format", "ttfa_deadline_s", "request_id", "text",
                           "input_audio"})  # fmt: skip
AUDIO_FIELDS = frozenset({"format", "sample_rate_hz"})
FIELDS = MicFields()


def mic_config(obj: dict) -> tuple[dict, int]:
    """`job_from_fields` keyword arguments (without the audio) and the stated input rate."""
    if "end_of_turn" in obj:
        raise InvalidArgumentError("end_of_turn", "send the config message first")
    unknown = set(obj) - CONFIG_FIELDS
    if unknown:
        raise InvalidArgumentError(printable_name(sorted(unknown)[0]), "unknown field")
    fmt = obj.get("response_format", "pcm")
    if not isinstance(fmt, str) or fmt not in OPENAI_FORMATS:
        raise InvalidArgumentError("response_format", "must be one of: pcm, wav")
    strings = {name: obj.get(name, "") for name in ("model", "voice", "request_id", "text")}
    for name, value in strings.items():
        if not isinstance(value, str):
            raise InvalidArgumentError(name, "must be a string")
    if not isinstance(obj.get("sampling", {}), dict):
        raise InvalidArgumentError("sampling", "must be an object of sampling fields")
    fields = {
        "text": strings["text"], "model": strings["model"], "voice": strings["voice"],
        "sampling": obj.get("sampling", {}), "output_format": OPENAI_FORMATS[fmt], "sample_rate_hz": 0,
        "ttfa_deadline_s": obj.get("ttfa_deadline_s", 0.0), "req_id": strings["request_id"],
    }  # fmt: skip
    return fields, input_rate(obj.get("input_audio"))


def input_rate(audio: object) -> int:
    """`input_audio: {"format": "pcm16", "sample_rate_hz": N}` (required: it says how to read the frames)."""
    if not isinstance(audio, dict):
        raise InvalidArgumentError("input_audio", 'required: {"format": "pcm16", "sample_rate_hz": <Hz>}')
    unknown = set(audio) - AUDIO_FIELDS
    if unknown:
        raise InvalidArgumentError(f"input_audio.{printable_name(sorted(unknown)[0])}", "unknown field")
    if audio.get("format", "pcm16") != "pcm16":
        raise InvalidArgumentError(FIELDS.encoding, "must be pcm16: microphone audio comes as raw samples")
    return check_rate(audio.get("sample_rate_hz"), FIELDS.rate)


async def receive(websocket: WebSocket) -> bytes | dict:
    """The next message: a binary frame's bytes or a JSON object (raises WebSocketDisconnect when the client left)."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    if message.get("bytes") is not None:
        return message["bytes"]
    text = message["text"]
    if len(text) > MAX_BODY_BYTES:
        raise InvalidArgumentError("message", f"larger than {MAX_BODY_BYTES} characters")
    return parse_json_object(text.encode("utf-8", "surrogatepass"))


def end_of_turn(obj: dict) -> None:
    """A JSON message during the turn: only `{"end_of_turn": true}`."""
    again = set(obj) & CONFIG_FIELDS
    if again:
        raise InvalidArgumentError(sorted(again)[0], "the turn is already configured (config is the first message)")
    unknown = set(obj) - {"end_of_turn"}
    if unknown:
        raise InvalidArgumentError(printable_name(sorted(unknown)[0]), "unknown field")
    if obj.get("end_of_turn") is not True:
        raise InvalidArgumentError("end_of_turn", "must be true (audio goes in binary messages)")


async def read_turn(websocket: WebSocket, turn: MicTurn, idle_timeout_s: float) -> None:
    """Feed binary frames to the turn until `{"end_of_turn": true}`."""
    while True:
        try:
            message = await asyncio.wait_for(receive(websocket), idle_timeout_s)
        except TimeoutError:
            raise IdleTimeout(f"no audio for {idle_timeout_s:g} s in the middle of a turn") from None
        if isinstance(message, bytes):
            turn.push(message)
        else:
            end_of_turn(message)
            return


async def refuse_after_turn(websocket: WebSocket) -> None:
    """While the answer plays: a client that leaves cancels it; a message is refused."""
    await receive(websocket)
    raise InvalidArgumentError("message", "the turn has ended; open another socket for the next turn")


async def send_answer(websocket: WebSocket, chunks: AsyncIterator[SentChunk], header: bytes) -> float:
    """The answer's text pieces and audio chunks as they come; returns the seconds of audio sent."""
    audio_s = 0.0
    async for sent in chunks:
        if sent.audio is None:
            await websocket.send_text(json.dumps({"type": "text", "text": sent.text}))
            continue
        audio = sent.audio
        if audio.is_final and not audio.pcm16:
            break
        data = (header if audio.seq == 0 else b"") + audio.pcm16
        meta = {"type": "audio", "seq": audio.seq, "num_bytes": len(data), "duration_s": round(audio.duration_s, 6)}
        await websocket.send_text(json.dumps(meta))
        await websocket.send_bytes(data)
        audio_s += audio.duration_s
    return audio_s


async def first_done(*coroutines) -> object:
    """The first coroutine's result (or its failure); the others are cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return done.pop().result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class MicEndpoint:
    """What the Router gives the endpoint: how to check the key, pick a model's core, and map a failure."""

    authorize: Callable[[WebSocket], AbstractAsyncContextManager[None]]
    core_for: Callable[[str], RouterCore]
    failure_of: FailureOf

    async def serve(self, websocket: WebSocket, fallback_req_id: str) -> None:
        await websocket.accept()
        req_id = fallback_req_id
        try:
            async with self.authorize(websocket):
                first = await receive(websocket)
                if isinstance(first, bytes):
                    raise InvalidArgumentError("config", "send the JSON config before any audio")
                fields, rate = mic_config(first)
                core = self.core_for(fields["model"])
                req_id = fields["req_id"] = fields["req_id"] or fallback_req_id
                turn = MicTurn(core.entry, core.config.speech_in, rate, FIELDS, core.mic_forward(rate))
                ready = {"type": "ready", "request_id": req_id, "sample_rate_hz": core.entry.sample_rate_hz}
                await websocket.send_text(json.dumps(ready))
                reading = read_turn(websocket, turn, core.config.incremental.idle_timeout_s)
                job = await turn_job(core.job, fields, turn, reading)
                rate_out = core.entry.sample_rate_hz
                header = streaming_wav_header(rate_out) if job.output_format == "wav" else b""
                async with aclosing(core.run(job)) as stream:  # closed on any failure: the replica frees it
                    audio_s = await first_done(send_answer(websocket, stream, header), refuse_after_turn(websocket))
            await websocket.send_text(json.dumps({"type": "done", "audio_s": round(audio_s, 6)}))
            await websocket.close(1000)
        except WebSocketDisconnect:
            return  # the client left: the turn (and any answer) is dropped on the way out
        except Exception as err:
            await send_failure(websocket, err, req_id, self.failure_of)

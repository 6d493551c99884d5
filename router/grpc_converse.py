"""The gRPC bidi `Converse` (streamed microphone input): the first message configures the turn (a
SynthesizeRequest whose `input_audio` states PCM16 and its rate; its data, if any, is the first
piece), the next ones carry `audio` pieces, then `end_of_turn` (or the client's half-close). Reading
feeds a `MicTurn`, whose front end works on each piece as it comes; the Router's method then runs
the turn's Job like Synthesize. A gap longer than the idle timeout ends the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from core.config import SpeechInConfig
from core.errors import InvalidArgumentError
from llm_stage.jobs import check_request_id
from llm_stage.registry import ModelEntry
from protos import voxray_pb2
from router.incremental import IdleTimeout
from router.jobs import fields_from_proto, parse_proto
from router.mic_tokens import ReplicaMicTokens
from router.mic_turn import MicFields, MicTurn, check_rate

FIELDS = MicFields(model="config.model", encoding="config.input_audio.format",
                   rate="config.input_audio.sample_rate_hz", audio="audio")  # fmt: skip


def _request(raw: bytes) -> voxray_pb2.ConverseRequest:
    message = parse_proto(voxray_pb2.ConverseRequest, raw)
    if message.WhichOneof("input") is None:
        raise InvalidArgumentError("input", "empty message: set one of config, audio, end_of_turn")
    return message


async def read_config(requests: AsyncIterator[bytes]) -> tuple[dict, int, bytes]:
    """The first message: its `job_from_fields` keyword arguments (without the audio), the stated
    rate and its first piece (the config's input_audio.data, possibly empty)."""
    try:
        first = _request(await anext(requests))
    except StopAsyncIteration:
        raise InvalidArgumentError("config", "the stream ended before its config message") from None
    if first.WhichOneof("input") != "config":
        raise InvalidArgumentError("config", f"the first message must be config, got {first.WhichOneof('input')}")
    if not first.config.HasField("input_audio"):
        raise InvalidArgumentError("config.input_audio", "required: it states the audio's format (PCM16) and rate")
    fields = fields_from_proto(first.config)
    # checked now, not when the job is built at the turn's end: a bad id fails before the audio streams
    fields["req_id"] = check_request_id(fields["req_id"], "config.request_id")
    audio = fields.pop("input_audio")
    if audio.format != "pcm16":
        raise InvalidArgumentError(FIELDS.encoding, "must be PCM16: microphone audio comes as raw samples")
    return {**fields, "input_audio": None}, check_rate(audio.sample_rate_hz, FIELDS.rate), audio.data


async def read_turn(requests: AsyncIterator[bytes], turn: MicTurn, idle_timeout_s: float) -> None:
    """Feed the turn's pieces to `turn` until end_of_turn or the half-close."""
    while True:
        try:
            raw = await asyncio.wait_for(anext(requests), idle_timeout_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise IdleTimeout(f"no audio for {idle_timeout_s:g} s in the middle of a turn") from None
        message = _request(raw)
        match message.WhichOneof("input"):
            case "config":
                raise InvalidArgumentError("config", "given twice: only the first message configures the turn")
            case "audio":
                turn.push(message.audio)
            case "end_of_turn":
                if message.end_of_turn:
                    return


def open_turn(
    entry: ModelEntry, config: SpeechInConfig, rate: int, first_piece: bytes, forward: ReplicaMicTokens | None = None
) -> MicTurn:
    """The turn at the stated rate on `entry`'s front end (and `forward`ed to a replica tokenizing it), its
    first piece (from the config) pushed."""
    turn = MicTurn(entry, config, rate, FIELDS, forward)
    if first_piece:
        turn.push(first_piece)
    return turn

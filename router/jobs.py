"""Turn a client's request (gRPC message bytes or HTTP JSON body) into a validated `Job`.

`fields_from_proto` parses and checks the wire format of `voxray.SynthesizeRequest`
(garbage bytes, unknown fields, unknown enum values); `fields_from_json` does the same for the
OpenAI-style JSON body (size, UTF-8, duplicate keys, NaN literals, nesting, field types, the
request id from the body or the X-Request-Id header). The served-model check is the router's
own; every other field is validated by `llm_stage.jobs.build_job` against the model family's
limits, once. Every rejection is an InvalidArgumentError naming the field as the client
spelled it, which the ingresses map to gRPC INVALID_ARGUMENT / HTTP 400.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass
from typing import Literal

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from core.config import AdmissionConfig, SpeechInConfig
from core.errors import InvalidArgumentError
from core.messages import AudioClip, ChatTurn, Job, OutputFormat
from llm_stage.jobs import build_job, check_name, check_request_id, check_text, printable_name
from llm_stage.registry import ModelEntry
from protos import voxray_pb2
from router.audio_input import INPUT_FORMATS, InputAudio, check_input_audio
from router.sse import STREAM_FORMATS, StreamFormat

MAX_BODY_BYTES = 64 * 1024  # 4000 characters of text, each escaped as \uXXXX, fit with room to spare
MAX_AUDIO_BYTES = 12 * 2**20  # input audio a request may carry on top (2 min of 48 kHz PCM16 and the WAV header)
MAX_AUDIO_JSON_BYTES = MAX_AUDIO_BYTES * 4 // 3 + 4  # the same audio as base64
PROTO_AUDIO_FORMATS: dict[int, str] = {voxray_pb2.INPUT_AUDIO_WAV: "wav", voxray_pb2.INPUT_AUDIO_PCM16: "pcm16"}
HTTP_FIELDS = frozenset(
    {"model", "input", "voice", "response_format", "stream", "stream_format", "speed", "sampling", "request_id",
     "input_audio"}
)  # fmt: skip
AUDIO_JSON_FIELDS = frozenset({"data", "format", "sample_rate_hz"})
OPENAI_FORMATS: dict[str, OutputFormat] = {"pcm": "pcm16", "wav": "wav"}
PROTO_FORMATS: dict[int, OutputFormat] = {voxray_pb2.AUDIO_FORMAT_PCM16: "pcm16", voxray_pb2.AUDIO_FORMAT_WAV: "wav"}


@dataclass(frozen=True)
class WireTurn:
    """An earlier turn of a chat as the client sent it (`router.chat_turns`), before checking;
    `field` is how the client names its content (e.g. `messages[2].content`)."""

    role: Literal["user", "assistant"]
    text: str
    field: str
    audio: InputAudio | None = None


def job_from_fields(
    entry: ModelEntry,
    admission: AdmissionConfig,
    *,
    text: object,
    model: str,
    voice: str,
    sampling: dict,
    output_format: OutputFormat,
    sample_rate_hz: int,
    ttfa_deadline_s: float,
    req_id: str,
    text_field: str = "text",
    input_audio: InputAudio | None = None,
    speech_in: SpeechInConfig | None = None,
    text_only: bool = False,
    text_only_field: str = "modalities",
    system: str = "",
    system_field: str = "system",
    history: tuple[WireTurn, ...] = (),
) -> Job:
    if model and check_name(model, "model") != entry.name:
        raise InvalidArgumentError("model", f"unknown model {model!r}; this server serves {entry.name!r}")
    if sample_rate_hz not in (0, entry.sample_rate_hz):
        raise InvalidArgumentError("sample_rate_hz", f"only {entry.sample_rate_hz} Hz is served")
    return build_job(
        entry.family.lm, text=text, voice=voice or None, sampling=sampling, req_id=req_id,
        ttfa_deadline_s=ttfa_deadline_s, default_ttfa_deadline_s=admission.default_ttfa_deadline_s,
        output_format=output_format, text_field=text_field, audio=_checked_audio(entry, input_audio, speech_in),
        audio_field=input_audio.field if input_audio is not None else "input_audio", text_only=text_only,
        text_only_field=text_only_field, system=system, system_field=system_field,
        history=tuple(_checked_turn(entry, turn, speech_in) for turn in history),
    )  # fmt: skip


def _checked_turn(entry: ModelEntry, turn: WireTurn, config: SpeechInConfig | None) -> ChatTurn:
    """An earlier turn checked as a last one is: its clip (a family that takes audio), its text (may be
    empty beside a clip); errors name the turn's own fields."""
    audio = _checked_audio(entry, turn.audio, config)
    text = check_text(entry.family.lm, turn.text, turn.field, may_be_empty=audio is not None)
    return ChatTurn(turn.role, text, audio)


def _checked_audio(entry: ModelEntry, audio: InputAudio | None, config: SpeechInConfig | None) -> AudioClip | None:
    """The clip of a speech-in request; a family that takes no audio refuses it before it is decoded."""
    if audio is None:
        return None
    if not entry.family.lm.takes_audio:
        raise InvalidArgumentError(audio.field, f"{entry.name} takes no audio (it speaks text)")
    return check_input_audio(audio, config or SpeechInConfig())


def parse_proto(message_type: type[Message], request: Message | bytes, max_bytes: int = MAX_BODY_BYTES) -> Message:
    """The request message, parsed from raw bytes (the gRPC proxy forwards them unparsed) or as
    given; garbage, truncated or non-UTF-8 bytes and fields this server does not know are refused."""
    if isinstance(request, (bytes, bytearray)):
        if len(request) > max_bytes:
            raise InvalidArgumentError("request", f"larger than {max_bytes} bytes")
        try:
            request = message_type.FromString(bytes(request))
        except DecodeError:
            raise InvalidArgumentError("request", f"is not a valid {message_type.DESCRIPTOR.full_name}") from None
    _check_no_unknown_fields(request, "request")
    return request


def _check_no_unknown_fields(message: Message, field: str) -> None:
    unknown = UnknownFieldSet(message)
    if len(unknown):
        raise InvalidArgumentError(field, f"unknown field number {unknown[0].field_number}")
    for descriptor, value in message.ListFields():
        if descriptor.message_type is not None and not descriptor.is_repeated:
            _check_no_unknown_fields(value, descriptor.name)


def parse_with_audio(message_type: type[Message], request: Message | bytes, audio_field: str) -> Message:
    """`parse_proto` for a message carrying an `InputAudio` at `audio_field`: the audio may take
    MAX_AUDIO_BYTES on top of the MAX_BODY_BYTES the other fields may take."""
    size = len(request) if isinstance(request, (bytes, bytearray)) else 0
    message = parse_proto(message_type, request, MAX_BODY_BYTES + MAX_AUDIO_BYTES)
    if size - len(getattr(message, audio_field).data) > MAX_BODY_BYTES:
        raise InvalidArgumentError("request", f"larger than {MAX_BODY_BYTES} bytes besides {audio_field}")
    return message


def fields_from_proto(request: voxray_pb2.SynthesizeRequest | bytes) -> dict:
    """`job_from_fields` keyword arguments from a SynthesizeRequest (or its bytes)."""
    request = parse_with_audio(voxray_pb2.SynthesizeRequest, request, "input_audio")
    if request.format not in PROTO_FORMATS:
        raise InvalidArgumentError(
            "format", f"unknown value {request.format}; use AUDIO_FORMAT_PCM16 or AUDIO_FORMAT_WAV"
        )
    if request.text_only:
        _check_no_speech_settings(request)
    audio = input_audio_from_proto(request.input_audio, "input_audio") if request.HasField("input_audio") else None
    return {
        "text": request.text, "model": request.model, "voice": request.voice,
        "sampling": sampling_from_proto(request.sampling), "output_format": PROTO_FORMATS[request.format],
        "sample_rate_hz": request.sample_rate_hz, "ttfa_deadline_s": request.ttfa_deadline_s,
        "req_id": request.request_id, "input_audio": audio, "text_only": request.text_only,
        "text_only_field": "text_only",
    }  # fmt: skip


def _check_no_speech_settings(request: voxray_pb2.SynthesizeRequest) -> None:
    """A text-only answer has no audio to shape: a voice or a WAV format is refused (as HTTP chat's
    `audio` settings are beside `modalities: ["text"]`)."""
    if request.voice:
        raise InvalidArgumentError("voice", "is for spoken answers; text_only answers in text alone")
    if request.format != voxray_pb2.AUDIO_FORMAT_PCM16:
        raise InvalidArgumentError("format", "is for spoken answers; text_only answers in text alone")


def input_audio_from_proto(audio: voxray_pb2.InputAudio, field: str) -> InputAudio:
    """An `InputAudio` message's fields, before checking; errors name `field` (e.g. `input_audio.format`)."""
    if audio.format not in PROTO_AUDIO_FORMATS:
        raise InvalidArgumentError(f"{field}.format", f"unknown value {audio.format}; use WAV or PCM16")
    return InputAudio(audio.data, PROTO_AUDIO_FORMATS[audio.format], audio.sample_rate_hz, field)  # type: ignore[arg-type]


def sampling_from_proto(options) -> dict:
    """The fields the client set on a SamplingOptions message."""
    return {descriptor.name: value for descriptor, value in options.ListFields()}


def fields_from_json(body: bytes, header_req_ids: list[str] = ()) -> dict:
    """`job_from_fields` keyword arguments from a `/v1/audio/speech` JSON body and the request's
    X-Request-Id header values (at most one; when the body names an id too, they must agree)."""
    return speech_request(body, header_req_ids)[0]


def speech_request(body: bytes, header_req_ids: list[str] = ()) -> tuple[dict, StreamFormat]:
    """A `/v1/audio/speech` body: its `job_from_fields` keyword arguments and its `stream_format`
    (OpenAI's: "audio", the raw audio stream, by default; "sse", server-sent events)."""
    obj = parse_json_object(body, MAX_BODY_BYTES + MAX_AUDIO_JSON_BYTES)
    if "input_audio" not in obj and len(body) > MAX_BODY_BYTES:
        raise InvalidArgumentError("body", f"larger than {MAX_BODY_BYTES} bytes")
    unknown = set(obj) - HTTP_FIELDS
    if unknown:
        raise InvalidArgumentError(printable_name(sorted(unknown)[0]), "unknown field")
    fmt = obj.get("response_format", "wav")
    if not isinstance(fmt, str) or fmt not in OPENAI_FORMATS:
        raise InvalidArgumentError("response_format", "must be one of: pcm, wav")
    speed = obj.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or speed != 1.0:
        raise InvalidArgumentError("speed", "must be the number 1.0 (the only speed served)")
    if not isinstance(obj.get("stream", True), bool):
        raise InvalidArgumentError("stream", "must be true or false")
    stream_format = obj.get("stream_format", "audio")
    if not isinstance(stream_format, str) or stream_format not in STREAM_FORMATS:
        raise InvalidArgumentError("stream_format", "must be one of: audio, sse")
    sampling = obj.get("sampling", {})
    if not isinstance(sampling, dict):
        raise InvalidArgumentError("sampling", "must be an object of sampling fields")
    fields = {
        "text": obj.get("input"), "model": _optional_str(obj, "model"), "voice": _optional_str(obj, "voice"),
        "sampling": sampling, "output_format": OPENAI_FORMATS[fmt], "sample_rate_hz": 0, "ttfa_deadline_s": 0.0,
        "req_id": http_request_id(obj.get("request_id"), header_req_ids), "text_field": "input",
        "input_audio": audio_from_json(obj.get("input_audio")),
    }  # fmt: skip
    return fields, stream_format


def audio_from_json(value: object, field: str = "input_audio") -> InputAudio | None:
    """`{"data": base64, "format": "wav" | "pcm16", "sample_rate_hz": int}` (the rate: PCM16 only)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgumentError(field, "must be an object with data, format and (PCM16) sample_rate_hz")
    unknown = set(value) - AUDIO_JSON_FIELDS
    if unknown:
        raise InvalidArgumentError(f"{field}.{printable_name(sorted(unknown)[0])}", "unknown field")
    fmt, rate = value.get("format", "wav"), value.get("sample_rate_hz", 0)
    if fmt not in INPUT_FORMATS:
        raise InvalidArgumentError(f"{field}.format", f"must be one of: {', '.join(INPUT_FORMATS)}")
    if isinstance(rate, bool) or not isinstance(rate, int):
        raise InvalidArgumentError(f"{field}.sample_rate_hz", "must be an integer")
    data = value.get("data")
    if not isinstance(data, str):
        raise InvalidArgumentError(f"{field}.data", "must be a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(f"{field}.data", "is not valid base64") from None
    return InputAudio(raw, fmt, rate, field)


def parse_json_object(body: bytes, max_bytes: int = MAX_BODY_BYTES) -> dict:
    """A JSON object from at most `max_bytes` of strict UTF-8 JSON: no duplicate keys, no
    NaN / Infinity literals, no nesting deep enough to exhaust the parser."""
    if len(body) > max_bytes:
        raise InvalidArgumentError("body", f"larger than {max_bytes} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgumentError("body", "is not valid UTF-8") from None
    try:
        obj = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except RecursionError:
        raise InvalidArgumentError("body", "is nested too deeply") from None
    except ValueError as err:
        if isinstance(err, InvalidArgumentError):
            raise
        raise InvalidArgumentError("body", "is not valid JSON") from None
    if not isinstance(obj, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    return obj


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise InvalidArgumentError(printable_name(dup), "given more than once")
    return obj


def _no_constant(name: str) -> float:
    raise InvalidArgumentError("body", f"{name} is not a JSON number")


def _optional_str(obj: dict, name: str) -> str:
    value = obj.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidArgumentError(name, "must be a string")
    return value


def http_request_id(body_value: object, header_values: list[str]) -> str:
    """The one request id of an HTTP request: from the body's `request_id` or the X-Request-Id
    header (decoded as latin-1 by the server, so non-ASCII bytes fail the printable check)."""
    if len(header_values) > 1:
        raise InvalidArgumentError("X-Request-Id", "given more than once")
    header = check_request_id(header_values[0], "X-Request-Id") if header_values else ""
    body = "" if body_value is None else check_request_id(body_value, "request_id")
    if header and body and header != body:
        raise InvalidArgumentError("request_id", "differs from the X-Request-Id header")
    return body or header


def reply_request_id(candidate: object) -> str:
    """The id to put on a reply: the client's when it is a valid one, else a fresh one."""
    try:
        given = check_request_id(candidate)
    except InvalidArgumentError:
        given = ""
    return given or uuid.uuid4().hex

"""Validate a synthesis request into a `Job`, once, against the served model's own limits.

Every ingress calls `build_job`: the Router for gRPC and HTTP (after `router.jobs` has mapped
the wire format to fields), the CLI and batch mode in-process, `LLMEngine.add_request` for
callers that hand it raw fields. Limits come from the model family (voices, text length,
sampling defaults and ranges); the only later check is the tokenized prompt against the KV
context, which needs the tokenizer (`LLMEngine.add_job`). Checks are strict: exact types (no
bool for a number, no string for a number), finite numbers within bounds, text that is valid
Unicode without control characters, request ids of printable ASCII. Every error is an
InvalidArgumentError naming the field as the client spelled it.
"""

from __future__ import annotations

import math
import re
import uuid

import pydantic

from core.errors import InvalidArgumentError, from_validation_error
from core.messages import AudioClip, ChatTurn, Job, OutputFormat, SamplingParams
from core.voices import is_voice_id
from llm_stage.models.base import LMAdapter

MAX_REQUEST_ID_CHARS = 128
MAX_NAME_CHARS = 128  # model and voice names
MAX_TTFA_DEADLINE_S = 300.0
REQUEST_ID = re.compile(r"[!-~]+")  # printable ASCII, no space: safe in headers, metadata and log lines
TEXT_WHITESPACE = frozenset("\t\n\r")  # the only control characters prose may carry


def check_unicode(value: str, field: str) -> str:
    """`value` as valid Unicode: no lone surrogates (not encodable as UTF-8) and no control
    characters other than tab / line breaks."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(field, "is not valid Unicode (lone surrogate)") from None
    bad = next((ch for ch in value if _is_control(ch) and ch not in TEXT_WHITESPACE), None)
    if bad is not None:
        raise InvalidArgumentError(field, f"contains the control character U+{ord(bad):04X}")
    return value


def _is_control(ch: str) -> bool:
    code = ord(ch)
    return code < 0x20 or 0x7F <= code < 0xA0


def printable_name(name: str) -> str:
    """A client-chosen key as it may appear in an error message: printable ASCII, bounded."""
    return name if 0 < len(name) <= 64 and name.isascii() and name.isprintable() else ascii(name[:64])


def check_text(adapter: type[LMAdapter] | LMAdapter, text: object, field: str, may_be_empty: bool = False) -> str:
    if may_be_empty and text is None:
        return ""
    if not isinstance(text, str):
        raise InvalidArgumentError(field, "must be a string")
    if len(text) > adapter.max_text_chars:
        raise InvalidArgumentError(field, f"is {len(text)} characters; the limit is {adapter.max_text_chars}")
    check_unicode(text, field)
    if not text.strip() and not may_be_empty:
        raise InvalidArgumentError(field, "must not be empty")
    return text


def check_name(value: object, field: str) -> str:
    """A short name (model, voice): a string, bounded, valid Unicode without line breaks."""
    if not isinstance(value, str):
        raise InvalidArgumentError(field, "must be a string")
    if len(value) > MAX_NAME_CHARS:
        raise InvalidArgumentError(field, f"longer than {MAX_NAME_CHARS} characters")
    if any(ch in TEXT_WHITESPACE for ch in value):
        raise InvalidArgumentError(field, "must not contain tabs or line breaks")
    return check_unicode(value, field)


def check_request_id(req_id: object, field: str = "request_id") -> str:
    """A client's request id: 1-128 printable ASCII characters (no space); '' = none given."""
    if not isinstance(req_id, str):
        raise InvalidArgumentError(field, "must be a string")
    if len(req_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgumentError(field, f"longer than {MAX_REQUEST_ID_CHARS} characters")
    if req_id and not REQUEST_ID.fullmatch(req_id):
        raise InvalidArgumentError(field, "must be printable ASCII without spaces")
    return req_id


def check_voice(adapter: type[LMAdapter] | LMAdapter, voice: str | None) -> str | None:
    """The voice to use (the family's default when none is named)."""
    if voice:
        check_name(voice, "voice")
    if is_voice_id(voice):  # a registered zero-shot voice: the LLM replica looks it up by id
        if not adapter.takes_registered_voices:
            raise InvalidArgumentError("voice", f"{adapter.family} does not take registered (zero-shot) voices")
        return voice
    if not adapter.voices:
        if voice:
            raise InvalidArgumentError("voice", f"{adapter.family} has no voices; leave it empty")
        return None
    voice = voice or adapter.default_voice
    if voice not in adapter.voices:
        raise InvalidArgumentError("voice", f"unknown voice {voice!r}; valid voices: {', '.join(adapter.voices)}")
    return voice


def check_sampling(sampling: SamplingParams | dict | None, default: SamplingParams) -> SamplingParams:
    """The client's sampling fields over the model's default, with exact types: an integer field
    takes only an integer, a float field an integer or a finite float, never a bool or a string."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return SamplingParams.resolve(sampling, default)
    if not isinstance(sampling, dict):
        raise InvalidArgumentError("sampling", "must be an object of sampling fields")
    for name, value in sampling.items():
        if name not in SamplingParams.model_fields:
            raise InvalidArgumentError(f"sampling.{printable_name(name)}", "unknown field")
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgumentError(f"sampling.{name}", "must be a finite number")
    try:
        return SamplingParams.model_validate({**default.model_dump(), **sampling}, strict=True)
    except pydantic.ValidationError as err:
        raise from_validation_error(err, "sampling") from None


def check_model_options(adapter: type[LMAdapter] | LMAdapter, sampling: SamplingParams) -> SamplingParams:
    """Per-request conditioning the family does not have is refused, not ignored."""
    if sampling.exaggeration is not None and adapter.default_sampling.exaggeration is None:
        raise InvalidArgumentError("sampling.exaggeration", f"{adapter.family} has no emotion exaggeration")
    return sampling


def check_deadline(ttfa_deadline_s: object) -> float:
    if isinstance(ttfa_deadline_s, bool) or not isinstance(ttfa_deadline_s, (int, float)):
        raise InvalidArgumentError("ttfa_deadline_s", "must be a number")
    if not math.isfinite(ttfa_deadline_s) or not 0 <= ttfa_deadline_s <= MAX_TTFA_DEADLINE_S:
        raise InvalidArgumentError("ttfa_deadline_s", f"must be a finite number in [0, {MAX_TTFA_DEADLINE_S:g}]")
    return float(ttfa_deadline_s)


def build_job(
    adapter: type[LMAdapter] | LMAdapter,
    *,
    text: object,
    voice: str | None = None,
    sampling: SamplingParams | dict | None = None,
    req_id: str = "",
    ttfa_deadline_s: float = 0.0,
    default_ttfa_deadline_s: float = 5.0,
    output_format: OutputFormat = "pcm16",
    text_field: str = "text",
    audio: AudioClip | None = None,
    audio_field: str = "input_audio",
    text_only: bool = False,
    text_only_field: str = "modalities",
    system: str = "",
    system_field: str = "system",
    history: tuple[ChatTurn, ...] = (),
) -> Job:
    """A Job for `adapter`'s family (its class or an instance); empty fields take the defaults. With
    `audio` (speech in, checked by the ingress) the family must take audio, and the text may be empty;
    `text_only` (an answer without speech) and `system` need a family that `answers_text_only`, else
    are refused naming `text_only_field` / `system_field` (how the client names them: HTTP chat's
    `modalities`, gRPC's `text_only`); `history` (earlier turns,
    checked by the ingress that names their fields) one that `takes_chat_history`, refused naming
    `messages`."""
    ttfa_deadline_s = check_deadline(ttfa_deadline_s)
    req_id = check_request_id(req_id)
    if audio is not None and not adapter.takes_audio:
        raise InvalidArgumentError(audio_field, f"{adapter.family} takes no audio (it speaks text)")
    if (text_only or system) and not adapter.answers_text_only:
        field = text_only_field if text_only else system_field
        raise InvalidArgumentError(field, f"{adapter.family} answers only in speech")
    if history and not adapter.takes_chat_history:
        raise InvalidArgumentError("messages", f"{adapter.family} takes one turn; it keeps no conversation")
    return Job(
        req_id=req_id or uuid.uuid4().hex,
        text=check_text(adapter, text, text_field, may_be_empty=audio is not None),
        audio=audio,
        voice=check_voice(adapter, voice),
        sampling=check_model_options(adapter, check_sampling(sampling, adapter.default_sampling)),
        ttfa_deadline_s=ttfa_deadline_s or default_ttfa_deadline_s,
        output_format=output_format,
        text_field=text_field,
        text_only=text_only,
        system=check_text(adapter, system, system_field, may_be_empty=True),
        history=history,
    )

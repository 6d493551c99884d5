"""Validate a synthesis request into a `Job`, once, against the served model's own limits.

Every ingress calls `build_job`: the Router for gRPC and HTTP, the CLI and batch mode
in-process, `LLMEngine.add_request` for callers that hand it raw fields. Limits come from the
model family (voices, text length, sampling defaults and ranges, sample rate); the only later
check is the tokenized prompt against the KV context, which needs the tokenizer
(`LLMEngine.add_job`). Every error is an InvalidArgumentError naming the field as the client
spelled it.
"""

from __future__ import annotations

import math
import uuid

from core.errors import InvalidArgumentError
from core.messages import Job, OutputFormat, SamplingParams
from llm_stage.models.base import LMAdapter

MAX_REQUEST_ID_CHARS = 128


def check_text(adapter: type[LMAdapter] | LMAdapter, text: object, field: str) -> str:
    if not isinstance(text, str):
        raise InvalidArgumentError(field, "must be a string")
    if not text.strip():
        raise InvalidArgumentError(field, "must not be empty")
    if len(text) > adapter.max_text_chars:
        raise InvalidArgumentError(field, f"is {len(text)} characters; the limit is {adapter.max_text_chars}")
    return text


def check_voice(adapter: type[LMAdapter] | LMAdapter, voice: str | None) -> str | None:
    """The voice to use (the family's default when none is named)."""
    if not adapter.voices:
        if voice:
            raise InvalidArgumentError("voice", f"{adapter.family} has no voices; leave it empty")
        return None
    voice = voice or adapter.default_voice
    if voice not in adapter.voices:
        raise InvalidArgumentError("voice", f"unknown voice {voice!r}; valid voices: {', '.join(adapter.voices)}")
    return voice


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
) -> Job:
    """A Job for `adapter`'s family (its class or an instance); empty fields take the defaults."""
    if not math.isfinite(ttfa_deadline_s) or ttfa_deadline_s < 0:
        raise InvalidArgumentError("ttfa_deadline_s", "must be a finite number >= 0")
    if len(req_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgumentError("request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters")
    return Job(
        req_id=req_id or uuid.uuid4().hex,
        text=check_text(adapter, text, text_field),
        voice=check_voice(adapter, voice),
        sampling=SamplingParams.resolve(sampling, adapter.default_sampling),
        ttfa_deadline_s=ttfa_deadline_s or default_ttfa_deadline_s,
        output_format=output_format,
        text_field=text_field,
    )

"""Validate client requests (gRPC message or HTTP JSON) into one `SynthesisJob`.

Every rejection is an InvalidArgumentError naming the field, which the ingresses map to
gRPC INVALID_ARGUMENT / HTTP 400. The job dict is what the LLMStage `generate` receives.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass

import pydantic

from cluster.config import AdmissionConfig
from cluster.errors import InvalidArgumentError, from_validation_error
from cluster.registry import ModelEntry
from cluster.types import SamplingParams


@dataclass(frozen=True)
class SynthesisJob:
    req_id: str
    text: str
    voice: str | None
    sampling: dict
    ttfa_deadline_s: float
    output_format: str  # "pcm16" | "wav"

    def to_dict(self) -> dict:
        return asdict(self)


def _check_sampling(sampling: dict) -> dict:
    try:
        SamplingParams(**sampling)
    except pydantic.ValidationError as err:
        raise from_validation_error(err, "sampling") from None
    return sampling


def build_job(
    entry: ModelEntry,
    admission: AdmissionConfig,
    *,
    text: str,
    model: str,
    voice: str,
    sampling: dict,
    output_format: str,
    sample_rate_hz: int,
    ttfa_deadline_s: float,
    req_id: str,
    text_field: str = "text",
) -> SynthesisJob:
    if not text or not text.strip():
        raise InvalidArgumentError(text_field, "must not be empty")
    if len(text) > admission.max_text_chars:
        raise InvalidArgumentError(text_field, f"is {len(text)} characters; the limit is {admission.max_text_chars}")
    if model and model != entry.name:
        raise InvalidArgumentError("model", f"unknown model {model!r}; this server serves {entry.name!r}")
    if voice and entry.voices and voice not in entry.voices:
        raise InvalidArgumentError("voice", f"unknown voice {voice!r}; valid voices: {', '.join(entry.voices)}")
    if sample_rate_hz not in (0, entry.sample_rate_hz):
        raise InvalidArgumentError("sample_rate_hz", f"only {entry.sample_rate_hz} Hz is served")
    if ttfa_deadline_s < 0:
        raise InvalidArgumentError("ttfa_deadline_s", "must be >= 0")
    if len(req_id) > 128:
        raise InvalidArgumentError("request_id", "longer than 128 characters")
    return SynthesisJob(
        req_id=req_id or uuid.uuid4().hex,
        text=text,
        voice=voice or entry.default_voice,
        sampling=_check_sampling(sampling),
        ttfa_deadline_s=ttfa_deadline_s or admission.default_ttfa_deadline_s,
        output_format=output_format,
    )


def sampling_from_proto(options) -> dict:
    """The fields the client set on a SamplingOptions message."""
    return {descriptor.name: value for descriptor, value in options.ListFields()}

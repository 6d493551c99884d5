"""Turn a client's request (gRPC message or HTTP JSON fields) into a validated `Job`.

The served-model check is the router's own; every other field is validated by
`llm_stage.jobs.build_job` against the model family's limits, once. Every rejection is an
InvalidArgumentError naming the field as the client spelled it, which the ingresses map to gRPC
INVALID_ARGUMENT / HTTP 400.
"""

from __future__ import annotations

from core.config import AdmissionConfig
from core.errors import InvalidArgumentError
from core.messages import Job, OutputFormat
from llm_stage.jobs import build_job
from llm_stage.registry import ModelEntry


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
) -> Job:
    if model and model != entry.name:
        raise InvalidArgumentError("model", f"unknown model {model!r}; this server serves {entry.name!r}")
    if sample_rate_hz not in (0, entry.sample_rate_hz):
        raise InvalidArgumentError("sample_rate_hz", f"only {entry.sample_rate_hz} Hz is served")
    return build_job(
        entry.family.lm, text=text, voice=voice or None, sampling=sampling, req_id=req_id,
        ttfa_deadline_s=ttfa_deadline_s, default_ttfa_deadline_s=admission.default_ttfa_deadline_s,
        output_format=output_format, text_field=text_field,
    )  # fmt: skip


def sampling_from_proto(options) -> dict:
    """The fields the client set on a SamplingOptions message."""
    return {descriptor.name: value for descriptor, value in options.ListFields()}

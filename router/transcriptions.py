"""Transcription (understanding alone), one place for both front ends: OpenAI-style `POST
/v1/audio/transcriptions` (one uploaded audio file in, its transcript out as `json` (`{"text", "usage"}`),
`text` (text/plain) or `verbose_json`) and gRPC `Transcribe` (`router.grpc_transcribe`).

Each front end reads its request into a `Transcription` with the checks here (`check_language`,
`check_temperature`); `transcription_job` then makes its Job: the audio decoded by the audio-input checks
(`router.audio_input`, errors naming the front end's field: `file` over HTTP, `audio.data` over gRPC), a
text-only speech-in job (`Job.text_only`) whose system turn is the family's transcription instruction
(`LMAdapter.transcription_system`: Step-Audio 2's published ASR prompt), `prompt` as the user's text beside
the audio, greedy unless `temperature` says otherwise, its text bounded by `with_text_bound` (Whisper's 448
tokens per 30 s window: a model that never ends its answer stops there); `transcribe` runs it. HTTP:
`read_transcription_form` reads the multipart/form-data body (bounded, one file part: `read_form`) and
checks its fields (`transcription_form`: `file`, `model`, `prompt`, `response_format`, `language`,
`temperature`, `stream`, `request_id`; any other is refused, naming it); `transcription_response` answers.

Approximate in `verbose_json` (and gRPC's answer), as nothing better is known: `segments` is one segment
spanning the whole clip (the model gives no timestamps), and `language` is the one asked for (`unknown`
when none was: there is no language detection). Exact: `duration` (the decoded clip's), `text`, the
segment's `temperature` and `compression_ratio` (Whisper's: UTF-8 bytes over zlib-compressed bytes). Not
reported: token ids, log-probabilities, the no-speech probability, word timestamps.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from core.errors import InvalidArgumentError
from core.messages import Job
from llm_stage.jobs import printable_name
from llm_stage.registry import ModelEntry
from router.audio_input import InputAudio
from router.jobs import MAX_AUDIO_BYTES, MAX_BODY_BYTES, http_request_id
from router.streams import SentChunk

MAX_UPLOAD_BYTES = MAX_AUDIO_BYTES + MAX_BODY_BYTES  # the audio file and the form's text fields
FORM_FIELDS = frozenset({"file", "model", "prompt", "response_format", "language", "temperature", "stream",
                         "request_id"})  # fmt: skip
RESPONSE_FORMATS = ("json", "text", "verbose_json")
LANGUAGE_NAMES = {"en": "english", "zh": "chinese"}  # verbose_json names languages as OpenAI does
ISO_639_1 = re.compile(r"[a-z]{2}")
TOKENS_PER_WINDOW = 448  # Whisper's decoder bound on the text of one 30 s window
WINDOW_S = 30.0


@dataclass(frozen=True)
class Transcription:
    """A transcription request as a front end read it, checked for type and range (the audio itself is
    checked when its Job is built); `request_id` is the client's ("" = none)."""

    audio: InputAudio
    model: str
    prompt: str
    language: str | None
    temperature: float
    request_id: str
    response_format: str = "json"  # HTTP's; gRPC answers a TranscribeResponse


async def read_transcription_form(request: Request) -> Transcription:
    """The checked fields of the request's upload (its spooled file closed once read)."""
    form = await read_form(request)
    try:
        return await transcription_form(form, request.headers.getlist("x-request-id"))
    finally:
        await form.close()


async def read_form(request: Request, max_bytes: int = MAX_UPLOAD_BYTES) -> FormData:
    """The multipart/form-data body (at most one file), refused past `max_bytes` without reading the rest."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "multipart/form-data":
        got = printable_name(content_type.split(";")[0].strip()) or "nothing"
        raise InvalidArgumentError("content-type", f"expected multipart/form-data, got {got}")
    parser = MultiPartParser(request.headers, _bounded(request.stream(), max_bytes), max_files=1, max_fields=16,
                             max_part_size=MAX_BODY_BYTES)  # fmt: skip
    try:
        return await parser.parse()
    except MultiPartException as err:
        raise InvalidArgumentError("body", f"is not valid multipart/form-data: {err.message}") from None


async def _bounded(stream: AsyncIterator[bytes], max_bytes: int) -> AsyncIterator[bytes]:
    size = 0
    async for part in stream:
        size += len(part)
        if size > max_bytes:
            raise InvalidArgumentError("body", f"larger than {max_bytes} bytes")
        yield part


async def transcription_form(form: FormData, header_req_ids: list[str] = ()) -> Transcription:
    """The checked fields of an upload (the request id: the body's or the X-Request-Id header's); each
    refusal names its field."""
    unknown = sorted(set(form.keys()) - FORM_FIELDS)
    if unknown:
        raise InvalidArgumentError(printable_name(unknown[0]), "unknown field")
    for name in form.keys():
        if len(form.getlist(name)) > 1:
            raise InvalidArgumentError(name, "given more than once")
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise InvalidArgumentError("file", "is required: the audio file as a multipart file part")
    if _text(form, "stream") not in ("", "false"):
        raise InvalidArgumentError("stream", "streamed transcriptions are not served; send false or leave it out")
    response_format = _text(form, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise InvalidArgumentError("response_format", f"must be one of: {', '.join(RESPONSE_FORMATS)}")
    return Transcription(
        audio=InputAudio(await upload.read(), "wav", 0, field="file", is_file=True), model=_text(form, "model"),
        prompt=_text(form, "prompt"), language=check_language(_text(form, "language")),
        temperature=_temperature(form), request_id=http_request_id(_text(form, "request_id") or None, header_req_ids),
        response_format=response_format,
    )  # fmt: skip


def _text(form: FormData, name: str) -> str:
    value = form.get(name, "")
    if not isinstance(value, str):
        raise InvalidArgumentError(name, "must be a text field, not a file")
    return value


def check_language(language: str) -> str | None:
    """An ISO-639-1 code, or None for ""; whether the family has an instruction for it is its own check."""
    if not language:
        return None
    if not ISO_639_1.fullmatch(language):
        raise InvalidArgumentError("language", "must be an ISO-639-1 code such as en")
    return language


def _temperature(form: FormData) -> float:
    raw = _text(form, "temperature")
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError("temperature", "must be a number") from None
    return check_temperature(value)


def check_temperature(value: float) -> float:
    """OpenAI's range 0-1; 0 (its default) decodes greedily."""
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise InvalidArgumentError("temperature", "must be a number from 0 to 1")
    return value


def transcription_job(request: Transcription, entry: ModelEntry, make_job: Callable[..., Job], req_id: str) -> Job:
    """The Job that transcribes `request` on `entry` (`make_job`: the served model's `job_from_fields`;
    `req_id`: the id to use when the client gave none), its text bounded by `with_text_bound`."""
    return with_text_bound(make_job(**job_fields(request, entry, request.request_id or req_id)))


def job_fields(request: Transcription, entry: ModelEntry, req_id: str) -> dict:
    """`job_from_fields` keyword arguments: a text-only speech-in job that transcribes the audio."""
    lm = entry.family.lm
    if not lm.answers_text_only:
        raise InvalidArgumentError("model", f"{entry.name} does not transcribe (it takes no audio)")
    return {
        "text": request.prompt, "model": request.model, "voice": "", "output_format": "pcm16",
        "sampling": {"temperature": request.temperature}, "sample_rate_hz": 0, "ttfa_deadline_s": 0.0,
        "text_field": "prompt", "req_id": req_id, "input_audio": request.audio, "text_only": True,
        "system": lm.transcription_system(request.language),
    }  # fmt: skip


async def transcribe(chunks: AsyncIterator[SentChunk]) -> str:
    """The transcript: the text of a transcription job's stream (`RouterCore.run`), closed on any failure."""
    async with aclosing(chunks) as stream:
        return "".join([sent.text async for sent in stream])


def with_text_bound(job: Job) -> Job:
    """`job` with at most TOKENS_PER_WINDOW tokens per started WINDOW_S of its audio (the family's own
    `max_tokens` when lower)."""
    bound = TOKENS_PER_WINDOW * max(1, math.ceil(clip_duration_s(job) / WINDOW_S))
    sampling = job.sampling.model_copy(update={"max_tokens": min(job.sampling.max_tokens, bound)})
    return dataclasses.replace(job, sampling=sampling)


def clip_duration_s(job: Job) -> float:
    return job.audio.duration_s if job.audio is not None else 0.0


def language_name(language: str | None) -> str:
    """The language asked for as verbose_json names it ("english"; the code itself when it has no name
    here; "unknown" when none was asked)."""
    return LANGUAGE_NAMES.get(language or "", language or "unknown")


def transcription_body(form: Transcription, job: Job, text: str) -> dict | str:
    """The answer in `form.response_format`: a dict (json, verbose_json) or the plain text."""
    duration_s = clip_duration_s(job)
    usage = {"type": "duration", "seconds": math.ceil(duration_s)}
    if form.response_format == "text":
        return text
    if form.response_format == "json":
        return {"text": text, "usage": usage}
    segment = {"id": 0, "seek": 0, "start": 0.0, "end": duration_s, "text": text,
               "temperature": form.temperature, "compression_ratio": compression_ratio(text)}  # fmt: skip
    return {"task": "transcribe", "language": language_name(form.language), "duration": duration_s, "text": text,
            "segments": [segment] if text else [], "usage": usage}  # fmt: skip


def transcription_response(form: Transcription, job: Job, text: str, headers: dict[str, str]) -> Response:
    body = transcription_body(form, job, text)
    if isinstance(body, str):
        return PlainTextResponse(body, headers=headers)
    return JSONResponse(body, headers=headers)


def compression_ratio(text: str) -> float:
    """Whisper's repetition signal: the text's UTF-8 bytes over their zlib-compressed size (0 for none)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0

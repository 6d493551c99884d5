"""`POST /v1/audio/transcriptions` at the ingress: a multipart upload read through Starlette's parser
becomes a text-only speech-in Job whose system turn is the family's transcription instruction, or an
INVALID_ARGUMENT / 400 naming the field; the answer in json, text and verbose_json."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import json
import wave
import zlib

import numpy as np
import pytest
from starlette.requests import Request
from urllib3.filepost import encode_multipart_formdata

from core.config import AdmissionConfig
from core.errors import InvalidArgumentError
from llm_stage.models.step_audio2 import TRANSCRIPTION_SYSTEM
from llm_stage.registry import get_entry
from router.jobs import job_from_fields
from router.transcriptions import (
    compression_ratio,
    read_form,
    read_transcription_form,
    transcription_body,
    transcription_job,
    transcription_response,
    with_text_bound,
)

ENTRY = get_entry("step-audio2-tiny")


def wav_file(seconds: float = 1.0, rate: int = 16_000, amplitude: float = 0.3) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    samples = (amplitude * np.sin(2 * np.pi * 200 * t) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(samples.tobytes())
    return out.getvalue()


WAV = wav_file()


def http_request(
    fields: list[tuple[str, object]], content_type: str | None = None, request_ids: tuple[str, ...] = ()
) -> Request:
    """A Starlette request carrying `fields` as multipart/form-data, its body in 64 KiB pieces."""
    body, multipart_type = encode_multipart_formdata(fields)
    pieces = [body[i : i + 65536] for i in range(0, len(body), 65536)]
    headers = [(b"content-type", (content_type or multipart_type).encode())]
    headers += [(b"x-request-id", request_id.encode()) for request_id in request_ids]

    async def receive() -> dict:
        piece = pieces.pop(0) if pieces else b""
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}, receive)


def upload(**overrides) -> list[tuple[str, object]]:
    fields: dict[str, object] = {"file": ("clip.wav", WAV, "audio/wav"), "model": "step-audio2-tiny"}
    fields.update(overrides)
    return [(name, value) for name, value in fields.items() if value is not None]


def http_transcription_job(fields: list[tuple[str, object]], entry=ENTRY, request_ids: tuple[str, ...] = ()):
    """The upload read as the route reads it, and its Job (`asr-0` when the client names no id)."""
    form = asyncio.run(read_transcription_form(http_request(fields, request_ids=request_ids)))
    return form, transcription_job(form, entry, functools.partial(job_from_fields, entry, AdmissionConfig()), "asr-0")


def test_an_upload_becomes_a_text_only_transcription_job() -> None:
    fields = upload(prompt="Names: Ada.", language="zh", temperature="0.2")
    form, job = http_transcription_job(fields, request_ids=("asr-1",))
    assert job.text_only and job.system == TRANSCRIPTION_SYSTEM["zh"] and job.text == "Names: Ada."
    assert job.audio.sample_rate_hz == 16_000 and job.audio.num_samples == 16_000
    assert job.sampling.temperature == 0.2 and job.req_id == "asr-1" and form.response_format == "json"
    _, plain = http_transcription_job(upload())  # the defaults: greedy, the English instruction, no text beside
    assert plain.sampling.temperature == 0.0 and plain.system == TRANSCRIPTION_SYSTEM["en"] and plain.text == ""
    assert plain.req_id == "asr-0" and plain.sampling.max_tokens == 448  # the route's own id; bounded


def test_the_text_is_bounded_per_30_s_of_audio() -> None:
    _, short = http_transcription_job(upload())
    _, long = http_transcription_job(upload(file=("clip.wav", wav_file(seconds=31.0), "audio/wav")))
    assert short.sampling.max_tokens == 448 and long.sampling.max_tokens == 896
    unbounded = dataclasses.replace(short, sampling=short.sampling.model_copy(update={"max_tokens": 4096}))
    assert with_text_bound(unbounded).sampling.max_tokens == 448


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"file": None}, "file"),
        ({"file": "not a file part"}, "file"),
        ({"file": ("clip.mp3", b"ID3\x03\x00 not a wav", "audio/mpeg")}, "file"),
        ({"file": ("clip.wav", wav_file(amplitude=0.0), "audio/wav")}, "file"),
        ({"file": ("clip.wav", wav_file(seconds=0.02), "audio/wav")}, "file"),
        ({"file": ("clip.wav", b"", "audio/wav")}, "file"),
        ({"response_format": "srt"}, "response_format"),
        ({"language": "fr"}, "language"),
        ({"language": "english"}, "language"),
        ({"temperature": "warm"}, "temperature"),
        ({"temperature": "1.5"}, "temperature"),
        ({"temperature": "nan"}, "temperature"),
        ({"stream": "true"}, "stream"),
        ({"timestamp_granularities[]": "word"}, "timestamp_granularities[]"),
        ({"model": "no-such-model"}, "model"),
        ({"prompt": "x" * 5000}, "prompt"),
        ({"request_id": "bad id\n"}, "request_id"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(overrides, field) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        http_transcription_job(upload(**overrides))
    assert err.value.field == field


def test_a_field_given_twice_a_family_without_audio_and_the_body_are_refused() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        http_transcription_job(upload() + [("model", "step-audio2-tiny")])
    assert err.value.field == "model" and "more than once" in err.value.message
    with pytest.raises(InvalidArgumentError) as err:
        http_transcription_job(upload(model="orpheus-tiny"), entry=get_entry("orpheus-tiny"))
    assert err.value.field == "model" and "does not transcribe" in err.value.message
    with pytest.raises(InvalidArgumentError) as err:
        asyncio.run(read_form(http_request(upload(), content_type="application/json")))
    assert err.value.field == "content-type"
    with pytest.raises(InvalidArgumentError) as err:
        asyncio.run(read_form(http_request(upload()), max_bytes=len(WAV) // 2))
    assert err.value.field == "body"
    with pytest.raises(InvalidArgumentError) as err:
        asyncio.run(read_form(http_request([], content_type="multipart/form-data")))  # no boundary
    assert err.value.field == "body"


def test_the_answer_formats() -> None:
    text = "Hello there. " * 8  # repetitive: compresses well
    form, job = http_transcription_job(upload(language="en", temperature="0.5"))
    assert transcription_body(form, job, text) == {"text": text, "usage": {"type": "duration", "seconds": 1}}
    as_text = transcription_response(dataclasses.replace(form, response_format="text"), job, text, {})
    assert as_text.media_type == "text/plain" and as_text.body.decode() == text
    verbose = transcription_body(dataclasses.replace(form, response_format="verbose_json"), job, text)
    assert verbose["task"] == "transcribe" and verbose["language"] == "english" and verbose["duration"] == 1.0
    [segment] = verbose["segments"]
    assert (segment["start"], segment["end"], segment["text"], segment["temperature"]) == (0.0, 1.0, text, 0.5)
    raw = text.encode()
    assert segment["compression_ratio"] == pytest.approx(len(raw) / len(zlib.compress(raw)))
    assert segment["compression_ratio"] > 2.0
    response = transcription_response(dataclasses.replace(form, response_format="verbose_json"), job, "", {"X": "1"})
    body = json.loads(response.body)
    assert body["segments"] == [] and body["text"] == "" and response.headers["x"] == "1"
    unknown = transcription_body(dataclasses.replace(form, response_format="verbose_json", language=None), job, text)
    assert unknown["language"] == "unknown" and compression_ratio("") == 0.0

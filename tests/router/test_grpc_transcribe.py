"""gRPC `Transcribe` at the ingress (`router.grpc_transcribe`): a TranscribeRequest becomes the same
text-only transcription Job as HTTP's upload of the same clip (one `router.transcriptions` path), or
INVALID_ARGUMENT naming the field as HTTP's 400 does (`audio` for HTTP's `file`); the answer carries
the text, the language asked as verbose_json names it and the clip's duration."""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import pytest

from core.config import AdmissionConfig, SpeechInConfig
from core.errors import InvalidArgumentError
from llm_stage.models.step_audio2 import TRANSCRIPTION_SYSTEM
from llm_stage.registry import get_entry
from protos import voxray_pb2
from router.grpc_transcribe import transcribe_response, transcription_from_proto
from router.jobs import MAX_BODY_BYTES, job_from_fields
from router.streams import SentChunk
from router.transcriptions import transcribe, transcription_job
from tests.router.test_transcriptions import http_transcription_job, upload, wav_file

ENTRY = get_entry("step-audio2-tiny")
WAV = wav_file(seconds=1.5)


def request(**overrides) -> voxray_pb2.TranscribeRequest:
    fields: dict = {"audio": voxray_pb2.InputAudio(data=WAV), "model": "step-audio2-tiny"}
    fields.update(overrides)
    return voxray_pb2.TranscribeRequest(**{name: value for name, value in fields.items() if value is not None})


def grpc_transcription_job(message: voxray_pb2.TranscribeRequest | bytes, entry=ENTRY, speech_in=None):
    """The request read as the Router's Transcribe reads it, and its Job (`grpc-0` when it names no id)."""
    transcription = transcription_from_proto(message.SerializeToString() if not isinstance(message, bytes) else message)
    make_job = functools.partial(job_from_fields, entry, AdmissionConfig(), speech_in=speech_in)
    return transcription, transcription_job(transcription, entry, make_job, "grpc-0")


def test_a_request_makes_the_http_uploads_job() -> None:
    overrides = {"prompt": "Names: Ada.", "language": "zh", "temperature": 0.25, "request_id": "asr-9"}
    _, over_grpc = grpc_transcription_job(request(**overrides))
    form_fields = upload(file=("clip.wav", WAV, "audio/wav"), prompt="Names: Ada.", language="zh",
                         temperature="0.25", request_id="asr-9")  # fmt: skip
    _, over_http = http_transcription_job(form_fields)
    assert over_grpc == over_http  # the same Job: clip, instruction, text, sampling, bound, id
    assert over_grpc.text_only and over_grpc.system == TRANSCRIPTION_SYSTEM["zh"] and over_grpc.req_id == "asr-9"
    assert over_grpc.sampling.max_tokens == 448 and over_grpc.sampling.temperature == 0.25
    _, plain = grpc_transcription_job(request())  # defaults: greedy, English's instruction, the server's id
    assert plain.sampling.temperature == 0.0 and plain.system == TRANSCRIPTION_SYSTEM["en"] and plain.text == ""
    assert plain.req_id == "grpc-0" and plain.audio.duration_s == 1.5


def test_pcm16_audio_is_taken_at_its_rate() -> None:
    pcm = wav_file(seconds=1.0, rate=24_000)[44:]  # the samples without the WAV header
    audio = voxray_pb2.InputAudio(data=pcm, format=voxray_pb2.INPUT_AUDIO_PCM16, sample_rate_hz=24_000)
    _, job = grpc_transcription_job(request(audio=audio))
    assert job.audio.sample_rate_hz == 24_000 and job.audio.duration_s == 1.0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"audio": None}, "audio"),
        ({"audio": voxray_pb2.InputAudio(data=b"ID3\x03\x00 not a wav")}, "audio.data"),
        ({"audio": voxray_pb2.InputAudio(data=wav_file(amplitude=0.0))}, "audio.data"),
        ({"audio": voxray_pb2.InputAudio(data=wav_file(seconds=0.02))}, "audio.data"),
        ({"audio": voxray_pb2.InputAudio()}, "audio.data"),
        ({"audio": voxray_pb2.InputAudio(data=WAV, format=7)}, "audio.format"),
        ({"audio": voxray_pb2.InputAudio(data=WAV, sample_rate_hz=24_000)}, "audio.sample_rate_hz"),
        ({"audio": voxray_pb2.InputAudio(data=b"\x01\x00" * 800, format=voxray_pb2.INPUT_AUDIO_PCM16)},
         "audio.sample_rate_hz"),
        ({"language": "fr"}, "language"),
        ({"language": "english"}, "language"),
        ({"temperature": 1.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"model": "no-such-model"}, "model"),
        ({"prompt": "x" * 5000}, "prompt"),
        ({"request_id": "bad id\n"}, "request_id"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(overrides, field) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        grpc_transcription_job(request(**overrides))
    assert err.value.field == field


def test_a_family_without_audio_bad_bytes_and_a_long_clip_are_refused() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        grpc_transcription_job(request(model="orpheus-tiny"), entry=get_entry("orpheus-tiny"))
    assert err.value.field == "model" and "does not transcribe" in err.value.message
    with pytest.raises(InvalidArgumentError) as err:
        grpc_transcription_job(b"\xff\xff\xff garbage")
    assert err.value.field == "request"
    with pytest.raises(InvalidArgumentError) as err:  # unknown field number 100
        grpc_transcription_job(request().SerializeToString() + b"\xa0\x06\x01")
    assert err.value.field == "request"
    with pytest.raises(InvalidArgumentError) as err:  # the text fields alone past the body's bound
        grpc_transcription_job(request(prompt="x" * (MAX_BODY_BYTES + 1)))
    assert err.value.field == "request" and "besides audio" in err.value.message
    with pytest.raises(InvalidArgumentError) as err:
        grpc_transcription_job(request(), speech_in=SpeechInConfig(max_audio_s=1.0))
    assert err.value.field == "audio.data" and "1.50 s" in err.value.message


async def _chunks(*texts: str):
    for text in texts:
        yield SentChunk(None, 0, None, 0.1, "llm-1", text=text)


def test_the_answer_carries_the_text_language_and_duration() -> None:
    transcription, job = grpc_transcription_job(request(language="zh", request_id="asr-2"))
    text = asyncio.run(transcribe(_chunks("Hello", " there.")))
    response = transcribe_response(transcription, job, text)
    assert (response.text, response.language, response.request_id) == ("Hello there.", "chinese", "asr-2")
    assert response.duration_s == 1.5
    unknown = transcribe_response(dataclasses.replace(transcription, language=None), job, "")
    assert unknown.language == "unknown" and unknown.text == ""

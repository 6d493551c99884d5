"""Text-only answers over gRPC (`SynthesizeRequest.text_only`): Synthesize and Converse map it onto the
Job as HTTP chat's `modalities: ["text"]` does; a family that answers only in speech refuses it naming
`text_only`, as do a voice or a WAV format beside it and SynthesizeStream's config; the answer's
AudioChunks carry text alone and end with a final one (`router.ingress._grpc_chunks`)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from core.config import AdmissionConfig, SpeechInConfig
from core.errors import InvalidArgumentError
from core.messages import AudioChunk, HopTimes
from llm_stage.registry import FAMILY_MODULES, get_entry
from protos import voxray_pb2
from router.grpc_converse import open_turn
from router.grpc_converse import read_config as read_converse_config
from router.grpc_stream import read_config as read_stream_config
from router.ingress import _grpc_chunks
from router.jobs import fields_from_proto, job_from_fields
from router.mic_turn import turn_job
from router.streams import SentChunk

STEP_AUDIO = get_entry("step-audio2-tiny")
TTS_FAMILIES = sorted(name for name in FAMILY_MODULES if not get_entry(name).family.lm.answers_text_only)


def tone_pcm16(seconds: float = 0.5, rate: int = 24_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()


def pcm_audio(data: bytes = b"", rate: int = 24_000) -> voxray_pb2.InputAudio:
    return voxray_pb2.InputAudio(data=data, format=voxray_pb2.INPUT_AUDIO_PCM16, sample_rate_hz=rate)


def synthesize_job(entry=STEP_AUDIO, **fields):
    request = voxray_pb2.SynthesizeRequest(**fields).SerializeToString()
    return job_from_fields(entry, AdmissionConfig(), **fields_from_proto(request))


def refused_field(call, *args, **kwargs) -> str:
    with pytest.raises(InvalidArgumentError) as err:
        call(*args, **kwargs)
    return err.value.field


def test_synthesize_with_input_audio_asks_for_a_text_only_answer() -> None:
    job = synthesize_job(text="Answer.", input_audio=pcm_audio(tone_pcm16()), text_only=True)
    assert job.text_only and job.text == "Answer." and job.audio.duration_s == 0.5
    spoken = synthesize_job(text="Answer.", input_audio=pcm_audio(tone_pcm16()))
    assert not spoken.text_only  # the default: text and speech


@pytest.mark.parametrize("family", TTS_FAMILIES)
def test_a_family_that_answers_only_in_speech_refuses_it_naming_text_only(family: str) -> None:
    entry = get_entry(f"{family}-tiny")
    assert refused_field(synthesize_job, entry, text="Hello there.", text_only=True) == "text_only"
    fields = {"text": "Hello there.", "model": "", "voice": "", "sampling": {}, "output_format": "pcm16",
              "sample_rate_hz": 0, "ttfa_deadline_s": 0.0, "req_id": "", "text_only": True}  # fmt: skip
    assert refused_field(job_from_fields, entry, AdmissionConfig(), **fields) == "modalities"  # HTTP chat's name


def test_speech_settings_beside_it_and_streamed_text_are_refused() -> None:
    clip = pcm_audio(tone_pcm16())
    assert refused_field(synthesize_job, input_audio=clip, text_only=True, voice="tara") == "voice"
    assert (
        refused_field(synthesize_job, input_audio=clip, text_only=True, format=voxray_pb2.AUDIO_FORMAT_WAV) == "format"
    )
    config = voxray_pb2.SynthesizeStreamRequest(config=voxray_pb2.SynthesizeRequest(text="Hi.", text_only=True))
    assert refused_field(asyncio.run, read_stream_config(_messages(config))) == "config.text_only"


async def _messages(*messages):
    for message in messages:
        yield message.SerializeToString()


def test_converse_config_asks_for_a_text_only_turn() -> None:
    pcm = tone_pcm16()
    config = voxray_pb2.SynthesizeRequest(text="Answer.", input_audio=pcm_audio(pcm[:960]), text_only=True)
    fields, rate, first_piece = asyncio.run(read_converse_config(_messages(voxray_pb2.ConverseRequest(config=config))))
    turn = open_turn(STEP_AUDIO, SpeechInConfig(), rate, first_piece)
    turn.push(pcm[960:])

    def make_job(**job_fields):
        return job_from_fields(STEP_AUDIO, AdmissionConfig(), **job_fields)

    async def fed() -> None:  # (the turn's pieces were pushed above)
        return None

    job = asyncio.run(turn_job(make_job, fields, turn, fed()))
    assert job.text_only and job.audio.duration_s == 0.5 and job.audio_features is not None


def _text(text: str) -> SentChunk:
    return SentChunk(None, 0, None, 0.1, "llm-1", text=text)


async def _sent(*chunks: SentChunk):
    for chunk in chunks:
        yield chunk


def _collect(job, *chunks: SentChunk) -> list[voxray_pb2.AudioChunk]:
    async def collect():
        return [chunk async for chunk in _grpc_chunks(job, _sent(*chunks), b"")]

    return asyncio.run(collect())


def test_a_text_only_answer_is_text_chunks_then_a_final_one() -> None:
    job = synthesize_job(text="Answer.", input_audio=pcm_audio(tone_pcm16()), text_only=True, request_id="t-1")
    chunks = _collect(job, _text("Hello"), _text(" there."))
    assert [(c.text, c.final, c.audio) for c in chunks] == [
        ("Hello", False, b""),
        (" there.", False, b""),
        ("", True, b""),
    ]
    assert {c.request_id for c in chunks} == {"t-1"} and chunks[-1].llm_replica == "llm-1"
    [empty] = _collect(job)  # an answer without text still ends with its final chunk
    assert empty.final and not empty.text


def test_a_spoken_answer_gets_no_extra_chunk() -> None:
    job = synthesize_job(text="Answer.", input_audio=pcm_audio(tone_pcm16()))
    audio = AudioChunk(job.req_id, 0, b"\x01\x00" * 4, 24_000, is_final=True, hops=HopTimes())
    chunks = _collect(job, _text("Hi."), SentChunk(audio, 0, 0.2, 0.2, "llm-1"))
    assert [(c.text, bool(c.audio), c.final) for c in chunks] == [("Hi.", False, False), ("", True, True)]

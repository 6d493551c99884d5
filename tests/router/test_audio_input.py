"""Speech in at the ingress: a request's audio (gRPC `input_audio`, HTTP `input_audio` with base64 data)
becomes the Job's AudioClip, or an INVALID_ARGUMENT / 400 naming the field."""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import pytest

from core.config import AdmissionConfig, SpeechInConfig
from core.errors import InvalidArgumentError
from llm_stage.registry import get_entry
from protos import voxray_pb2
from router.jobs import MAX_BODY_BYTES, fields_from_proto, job_from_fields, speech_request

SPEECH_IN = get_entry("step-audio2-tiny")


def tone(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 200 * t) * 32767).astype("<i2")


def wav_bytes(samples: np.ndarray, rate: int, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(np.repeat(samples, channels).tobytes())
    return out.getvalue()


def grpc_job(audio: voxray_pb2.InputAudio, text: str = "", entry=SPEECH_IN, config=SpeechInConfig()):
    request = voxray_pb2.SynthesizeRequest(text=text, input_audio=audio)
    fields = fields_from_proto(request.SerializeToString())
    return job_from_fields(entry, AdmissionConfig(), speech_in=config, **fields)


def field_of(call) -> str:
    with pytest.raises(InvalidArgumentError) as err:
        call()
    return err.value.field


def test_grpc_wav_and_pcm16_become_the_jobs_clip() -> None:
    samples = tone(1.5, 24_000)
    job = grpc_job(voxray_pb2.InputAudio(data=wav_bytes(samples, 24_000, channels=2)))
    assert job.text == "" and job.audio.sample_rate_hz == 24_000
    assert np.array_equal(np.frombuffer(job.audio.pcm16, "<i2"), samples)  # stereo mixed to mono, same samples
    pcm = grpc_job(voxray_pb2.InputAudio(data=samples.tobytes(), format=voxray_pb2.INPUT_AUDIO_PCM16,
                                         sample_rate_hz=24_000), text="Answer briefly.")  # fmt: skip
    assert pcm.audio == job.audio and pcm.text == "Answer briefly."


@pytest.mark.parametrize(
    ("audio", "field"),
    [
        (voxray_pb2.InputAudio(data=b"RIFFnot a wav"), "input_audio.data"),
        (voxray_pb2.InputAudio(data=tone(1, 16_000).tobytes(), format=voxray_pb2.INPUT_AUDIO_PCM16),
         "input_audio.sample_rate_hz"),
        (voxray_pb2.InputAudio(data=tone(1, 16_000).tobytes(), format=voxray_pb2.INPUT_AUDIO_PCM16,
                               sample_rate_hz=12_345), "input_audio.sample_rate_hz"),
        (voxray_pb2.InputAudio(data=tone(1, 16_000).tobytes()[:-1], format=voxray_pb2.INPUT_AUDIO_PCM16,
                               sample_rate_hz=16_000), "input_audio.data"),
        (voxray_pb2.InputAudio(data=np.zeros(16_000, "<i2").tobytes(), format=voxray_pb2.INPUT_AUDIO_PCM16,
                               sample_rate_hz=16_000), "input_audio.data"),
        (voxray_pb2.InputAudio(data=wav_bytes(tone(1, 16_000), 16_000), sample_rate_hz=24_000),
         "input_audio.sample_rate_hz"),
        (voxray_pb2.InputAudio(data=wav_bytes(tone(1, 16_000), 16_000), format=7), "input_audio.format"),
    ],
)  # fmt: skip
def test_bad_grpc_audio_names_its_field(audio, field) -> None:
    assert field_of(lambda: grpc_job(audio)) == field


def test_duration_bounds_and_families_that_take_no_audio() -> None:
    long = voxray_pb2.InputAudio(data=wav_bytes(tone(3, 16_000), 16_000))
    assert field_of(lambda: grpc_job(long, config=SpeechInConfig(max_audio_s=2.0))) == "input_audio.data"
    assert field_of(lambda: grpc_job(long, entry=get_entry("orpheus-tiny"), text="hi")) == "input_audio"
    assert field_of(lambda: grpc_job(voxray_pb2.InputAudio(data=b""))) == "input_audio.data"
    fields = fields_from_proto(voxray_pb2.SynthesizeRequest(text=" "))  # no audio: text is required as ever
    assert field_of(lambda: job_from_fields(SPEECH_IN, AdmissionConfig(), **fields)) == "text"


def http_body(**fields) -> bytes:
    return json.dumps({"model": "step-audio2-tiny", **fields}).encode()


def test_http_input_audio_base64() -> None:
    samples = tone(1, 16_000)
    audio = {"data": base64.b64encode(samples.tobytes()).decode(), "format": "pcm16", "sample_rate_hz": 16_000}
    fields, _ = speech_request(http_body(input_audio=audio))
    job = job_from_fields(SPEECH_IN, AdmissionConfig(), **fields)
    assert job.text == "" and np.array_equal(np.frombuffer(job.audio.pcm16, "<i2"), samples)
    assert len(http_body(input_audio=audio)) > MAX_BODY_BYTES / 2  # audio may exceed the text-only limit's share


@pytest.mark.parametrize(
    ("audio", "field"),
    [
        ("abc", "input_audio"),
        ({"data": "%%%", "format": "wav"}, "input_audio.data"),
        ({"data": "", "format": "mp3"}, "input_audio.format"),
        ({"data": "", "format": "pcm16", "sample_rate_hz": "16k"}, "input_audio.sample_rate_hz"),
        ({"data": "", "voice": "x"}, "input_audio.voice"),
    ],
)
def test_bad_http_audio_names_its_field(audio, field) -> None:
    assert field_of(lambda: speech_request(http_body(input_audio=audio))) == field


def test_http_body_without_audio_keeps_its_limit() -> None:
    assert field_of(lambda: speech_request(http_body(input="x" * (MAX_BODY_BYTES + 10)))) == "body"


def test_answer_text_goes_out_as_text_only_chunks_and_sse_events() -> None:
    """The Router's replies for a speech-in job: a text-only gRPC AudioChunk, an SSE speech.text.delta
    before the audio's, and no text in the raw audio body."""
    import asyncio
    from contextlib import AsyncExitStack

    from core.messages import AudioChunk
    from router.ingress import _http_body, _sse_body, _to_proto
    from router.streams import SentChunk

    job = job_from_fields(SPEECH_IN, AdmissionConfig(), **speech_request(http_body(input="Hi"))[0])
    text = SentChunk(None, 0, None, 0.05, "llm-1", text="Hel")
    audio = SentChunk(AudioChunk(job.req_id, 0, b"\x01\x00" * 4, 24_000, True, num_frames=1), 0, 0.1, 0.1)
    proto = _to_proto(job, text, b"")
    assert (proto.text, proto.audio, proto.seq, proto.llm_replica) == ("Hel", b"", 0, "llm-1")

    async def rest():
        yield audio

    async def collect(body) -> list[bytes]:
        return [part async for part in body]

    sse = asyncio.run(collect(_sse_body(job, text, rest(), b"", AsyncExitStack())))
    kinds = [json.loads(part.decode().split("data: ", 1)[1])["type"] for part in sse]
    assert kinds == ["speech.text.delta", "speech.audio.delta", "speech.audio.done"]
    raw = asyncio.run(collect(_http_body(text, rest(), b"HDR", AsyncExitStack())))
    assert b"".join(raw) == b"HDR" + b"\x01\x00" * 4

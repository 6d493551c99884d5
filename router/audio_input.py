"""Input audio as a client sends it (speech in): a WAV file or raw PCM16 at a stated rate, checked once
at the ingress into the `AudioClip` a Job carries.

Every rejection is an InvalidArgumentError naming the client's field (`input_audio.data`,
`input_audio.format`, `input_audio.sample_rate_hz`; the HTTP body's own names): not a WAV file, an
odd number of PCM16 bytes, an unsupported rate or one that contradicts the file's, no samples,
silence, a duration outside `SpeechInConfig`. Used by `router.jobs` for gRPC and HTTP alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from core.config import SpeechInConfig
from core.errors import InvalidArgumentError
from core.messages import AudioClip
from detok_stage.voice.clip import SILENCE_PEAK, SUPPORTED_RATES_HZ, decode_clip

InputFormat = Literal["wav", "pcm16"]
INPUT_FORMATS: tuple[InputFormat, ...] = ("wav", "pcm16")


@dataclass(frozen=True)
class InputAudio:
    """The wire fields before checking; `field` is how the client names the audio (e.g. `input_audio`)."""

    data: bytes
    format: InputFormat
    sample_rate_hz: int  # 0 = the WAV file's own
    field: str = "input_audio"
    is_file: bool = False  # an uploaded file (multipart `file`): errors name `field` itself, not `field.data`


def check_input_audio(audio: InputAudio, config: SpeechInConfig) -> AudioClip:
    """The clip as mono PCM16 at its own rate, or an InvalidArgumentError naming the field."""
    data_field = audio.field if audio.is_file else f"{audio.field}.data"
    rate_field = f"{audio.field}.sample_rate_hz"
    if audio.format == "wav":
        clip = decode_clip(audio.data, data_field, 0.0, float("inf"))
        if audio.sample_rate_hz not in (0, clip.sample_rate_hz):
            raise InvalidArgumentError(rate_field, f"is {audio.sample_rate_hz} Hz; the file says {clip.sample_rate_hz}")
        samples, rate = clip.wave.numpy(), clip.sample_rate_hz
    else:
        samples, rate = _pcm16_samples(audio.data, audio.sample_rate_hz, data_field, rate_field)
    duration_s = samples.size / rate
    if not config.min_audio_s <= duration_s <= config.max_audio_s:
        raise InvalidArgumentError(
            data_field, f"is {duration_s:.2f} s long; {config.min_audio_s:g} to {config.max_audio_s:g} s are accepted"
        )
    pcm16 = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")
    return AudioClip(pcm16.tobytes(), rate)


def _pcm16_samples(data: bytes, rate: int, data_field: str, rate_field: str) -> tuple[np.ndarray, int]:
    if rate not in SUPPORTED_RATES_HZ:
        rates = ", ".join(str(r) for r in SUPPORTED_RATES_HZ)
        raise InvalidArgumentError(rate_field, f"is {rate} Hz; PCM16 needs one of {rates}")
    if not data:
        raise InvalidArgumentError(data_field, "is empty")
    if len(data) % 2:
        raise InvalidArgumentError(data_field, f"has {len(data)} bytes; PCM16 samples are 2 bytes each")
    samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    if float(np.abs(samples).max()) < SILENCE_PEAK:
        raise InvalidArgumentError(data_field, "is silent")
    return samples, rate

"""Reference clips: every bad one is refused naming the client's field; good ones decode to mono floats."""

from __future__ import annotations

import io
import math
import struct
import wave

import numpy as np
import pytest

from core.errors import InvalidArgumentError
from detok_stage.voice.clip import decode_clip


def wav_bytes(seconds: float = 2.0, rate: int = 24_000, channels: int = 1, width: int = 2, amplitude: float = 0.3):
    n = int(seconds * rate)
    tone = amplitude * np.sin(2 * math.pi * 220 * np.arange(n) / rate)
    frames = np.repeat(tone[:, None], channels, axis=1).reshape(-1)
    if width == 1:
        raw = (frames * 127 + 128).astype(np.uint8).tobytes()
    else:
        raw = (frames * (2 ** (8 * width - 1) - 1)).astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(width)
        wav.setframerate(rate)
        wav.writeframes(raw)
    return buf.getvalue()


def float_wav() -> bytes:
    """A WAVE_FORMAT_IEEE_FLOAT file (format tag 3), which `wave` does not read."""
    data = np.zeros(16_000, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 16_000, 64_000, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def decode(data: bytes):
    return decode_clip(data, "audio", 1.0, 20.0)


@pytest.mark.parametrize("rate, channels, width", [(24_000, 1, 2), (48_000, 2, 2), (16_000, 1, 1), (44_100, 1, 4)])
def test_good_clips_decode_to_mono_floats(rate, channels, width):
    clip = decode(wav_bytes(rate=rate, channels=channels, width=width))
    assert clip.sample_rate_hz == rate and clip.wave.shape == (2 * rate,) and abs(clip.duration_s - 2.0) < 1e-6
    assert 0.25 < float(clip.wave.abs().max()) < 0.35


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "is empty"),
        (b"this is not audio at all, just some text bytes", "is not a PCM WAV"),
        (b"RIFF\x00\x00", "is not a PCM WAV"),
        (float_wav(), "is not a PCM WAV"),
        (wav_bytes(rate=8_000), "sample rate 8000 Hz"),
        (wav_bytes(rate=96_000), "sample rate 96000 Hz"),
        (wav_bytes(seconds=0.0), "has no audio samples"),
        (wav_bytes(seconds=0.4), "is 0.40 s long"),
        (wav_bytes(seconds=25.0, rate=16_000), "is 25.00 s long"),
        (wav_bytes(amplitude=0.0), "is silent"),
    ],
    ids=["empty", "text", "truncated", "float", "8k", "96k", "no-samples", "short", "long", "silent"],
)
def test_bad_clips_are_refused_naming_the_field(data, words):
    with pytest.raises(InvalidArgumentError) as err:
        decode(data)
    assert err.value.field == "audio" and words in err.value.message

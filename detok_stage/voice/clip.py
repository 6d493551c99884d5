"""A reference clip as a client sends it (a WAV file), checked and decoded to mono float samples.

Every rejection is an InvalidArgumentError naming the client's field: not a WAV file, an encoding
other than PCM 8/16/24/32-bit, an unsupported sample rate, no samples, silence, or a duration
outside the configured bounds.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass

import numpy as np
import torch

from core.errors import InvalidArgumentError

SUPPORTED_RATES_HZ = (16_000, 22_050, 24_000, 32_000, 44_100, 48_000)
SILENCE_PEAK = 1e-4  # a clip whose loudest sample is below this carries no voice


@dataclass(frozen=True)
class Clip:
    wave: torch.Tensor  # [N] float32 in [-1, 1], mono
    sample_rate_hz: int

    @property
    def duration_s(self) -> float:
        return self.wave.numel() / self.sample_rate_hz


def _pcm_to_float(frames: bytes, width: int, channels: int) -> np.ndarray:
    if width == 1:  # unsigned 8-bit
        data = (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # little-endian 24-bit: sign-extend into int32
        raw = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        data = ((raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 2**23
    else:
        dtype = {2: "<i2", 4: "<i4"}[width]
        data = np.frombuffer(frames, dtype=dtype).astype(np.float32) / float(2 ** (8 * width - 1))
    return data.reshape(-1, channels).mean(axis=1)


def decode_clip(data: bytes, field: str, min_s: float, max_s: float) -> Clip:
    """The clip in `data` (a RIFF/WAVE PCM file), mono; rejects name `field`."""
    if not data:
        raise InvalidArgumentError(field, "is empty")
    try:
        with wave.open(io.BytesIO(data)) as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            frames = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as err:
        raise InvalidArgumentError(field, f"is not a PCM WAV file ({err})") from None
    if width not in (1, 2, 3, 4) or channels < 1:
        raise InvalidArgumentError(field, f"has {width}-byte samples; PCM 8, 16, 24 or 32-bit is supported")
    if rate not in SUPPORTED_RATES_HZ:
        rates = ", ".join(str(r) for r in SUPPORTED_RATES_HZ)
        raise InvalidArgumentError(field, f"has sample rate {rate} Hz; supported: {rates}")
    usable = len(frames) - len(frames) % (width * channels)
    if usable == 0:
        raise InvalidArgumentError(field, "has no audio samples")
    samples = torch.from_numpy(_pcm_to_float(frames[:usable], width, channels).copy())
    clip = Clip(samples, rate)
    if not min_s <= clip.duration_s <= max_s:
        raise InvalidArgumentError(
            field, f"is {clip.duration_s:.2f} s long; a voice clip takes {min_s:g} to {max_s:g} s"
        )
    if float(samples.abs().max()) < SILENCE_PEAK:
        raise InvalidArgumentError(field, "is silent")
    return clip

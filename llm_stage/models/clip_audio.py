"""A speech-in clip's PCM16 as float samples, at its own rate or resampled to the 16 kHz both speech-in
families' encoders read (Step-Audio 2's Whisper-style encoder, GLM-4-Voice's WhisperVQ tokenizer)."""

from __future__ import annotations

import numpy as np
import torch

from core.messages import AudioClip
from detok_stage.voice.features import resample

ENCODER_RATE_HZ = 16_000


def pcm16_wave(pcm16: bytes) -> torch.Tensor:
    """Little-endian PCM16 -> float samples [N] in [-1, 1]."""
    return torch.from_numpy(np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768.0)


def clip_wave(clip: AudioClip) -> torch.Tensor:
    """The clip's PCM16 as float samples [N] in [-1, 1] at its own rate."""
    return pcm16_wave(clip.pcm16)


def clip_wave_16k(clip: AudioClip) -> torch.Tensor:
    """The clip's float samples at 16 kHz (resampled when sent at another rate)."""
    return resample(clip_wave(clip), clip.sample_rate_hz, ENCODER_RATE_HZ)

"""A speech-in clip's PCM16 as float samples, at its own rate or resampled to the 16 kHz both speech-in
families' encoders read (Step-Audio 2's Whisper-style encoder, GLM-4-Voice's WhisperVQ tokenizer), and
its content key (what the adapters keep a clip's tokens or encoded rows by)."""

from __future__ import annotations

import hashlib

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


def clip_key(clip: AudioClip) -> bytes:
    """The clip's content key: its samples and rate."""
    return hashlib.blake2b(clip.pcm16, digest_size=16, person=clip.sample_rate_hz.to_bytes(8, "little")).digest()

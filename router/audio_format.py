"""Audio framing: PCM16 mono to WAV bytes (header + data), for the CLI and the ingresses."""

from __future__ import annotations

import io
import struct
import wave
from pathlib import Path


def wav_bytes(pcm16: bytes, sample_rate_hz: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate_hz)
        out.writeframes(pcm16)
    return buffer.getvalue()


def write_wav(path: Path, pcm16: bytes, sample_rate_hz: int) -> None:
    Path(path).write_bytes(wav_bytes(pcm16, sample_rate_hz))


def streaming_wav_header(sample_rate_hz: int) -> bytes:
    """A WAV header with unknown length (0xFFFFFFFF sizes), for streamed responses."""
    byte_rate = sample_rate_hz * 2
    return (
        b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate_hz, byte_rate, 2, 16)
        + b"data" + struct.pack("<I", 0xFFFFFFFF)
    )  # fmt: skip

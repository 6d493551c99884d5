"""Join segments' audio without a click: a linear fade to zero over a segment's last samples and
from zero over the next segment's first ones, so the waveform meets at 0 on both sides of the
join (chunks already end at codec frame edges). PCM16 in, PCM16 out; `IncrementalSession` uses it.
"""

from __future__ import annotations

import numpy as np


def fade_samples(sample_rate_hz: int, fade_ms: float) -> int:
    return round(sample_rate_hz * fade_ms / 1000)


def _ramp(pcm16: bytes, num_samples: int, rising: bool) -> bytes:
    samples = np.frombuffer(pcm16, dtype="<i2").astype(np.float64)
    n = min(num_samples, len(samples))
    if n == 0:
        return pcm16
    gain = np.linspace(0.0, 1.0, n + 1)[:-1] if rising else np.linspace(1.0, 0.0, n + 1)[1:]
    if rising:
        samples[:n] *= gain
    else:
        samples[-n:] *= gain
    return np.round(samples).astype("<i2").tobytes()


def fade_in(pcm16: bytes, num_samples: int) -> bytes:
    """The first `num_samples` ramped up from exactly 0 (sample 0 becomes 0)."""
    return _ramp(pcm16, num_samples, rising=True)


def fade_out(pcm16: bytes, num_samples: int) -> bytes:
    """The last `num_samples` ramped down to exactly 0 (the last sample becomes 0)."""
    return _ramp(pcm16, num_samples, rising=False)

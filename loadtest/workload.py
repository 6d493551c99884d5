"""The sweep's workload: bundled prompts, their audio lengths, arrival processes, loopback guard.

Prompts are public-domain sentences (loadtest/prompts.txt). Random-weight presets never stop on
their own, so each prompt's `max_tokens` follows its length (speech at ~15 chars/s).
"""

from __future__ import annotations

import ipaddress
import math
import random
import socket
from pathlib import Path

PROMPTS_PATH = Path(__file__).with_name("prompts.txt")
ORPHEUS_TOKENS_PER_FRAME = 7
FRAMES_PER_CHAR = 0.78  # 11.7 frames/s of audio at ~15 characters/s of speech
MIN_FRAMES, MAX_FRAMES = 8, 48  # 0.7 s .. 4.1 s of audio per request


def load_prompts(path: Path = PROMPTS_PATH) -> list[str]:
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


ORPHEUS_FRAME_RATE_HZ = 24000 / 2048  # SNAC 24 kHz: 2048 samples per frame


def max_tokens_for(
    text: str, frame_rate_hz: float | None = None, steps_per_frame: float = ORPHEUS_TOKENS_PER_FRAME
) -> int:
    """LM steps for `text`: Orpheus frames from its length, clamped to [MIN_FRAMES, MAX_FRAMES]; for
    another family (`frame_rate_hz`, `steps_per_frame`) the same audio length in its frames."""
    frames = min(MAX_FRAMES, max(MIN_FRAMES, round(len(text) * FRAMES_PER_CHAR)))
    if frame_rate_hz is not None:
        frames = round(frames / ORPHEUS_FRAME_RATE_HZ * frame_rate_hz)
    return math.ceil(frames * steps_per_frame)


def arrival_offsets_s(
    rate_rps: float, duration_s: float, min_requests: int, max_requests: int, rng: random.Random,
    process: str = "poisson", gamma_cv: float = 2.0,
) -> list[float]:  # fmt: skip
    """Open-loop send times: arrivals within `duration_s`, at least `min_requests`, at most `max_requests`.

    `poisson`: exponential gaps. `gamma`: gamma gaps with the same mean and coefficient of
    variation `gamma_cv` (> 1 is burstier than Poisson).
    """
    if rate_rps <= 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    if process not in ("poisson", "gamma"):
        raise ValueError(f"process must be 'poisson' or 'gamma', got {process!r}")
    shape = 1.0 / gamma_cv**2
    offsets: list[float] = []
    t = 0.0
    while len(offsets) < max_requests:
        gap = rng.expovariate(rate_rps) if process == "poisson" else rng.gammavariate(shape, 1.0 / (rate_rps * shape))
        t += gap
        if t > duration_s and len(offsets) >= min_requests:
            break
        offsets.append(t)
    return offsets


def is_loopback(target: str) -> bool:
    """True when `host:port` resolves only to loopback addresses."""
    host = target.rsplit(":", 1)[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_target(target: str, allow_remote: bool) -> None:
    """Refuse to load anything but loopback unless the caller opted in explicitly."""
    if not allow_remote and not is_loopback(target):
        raise ValueError(f"target {target!r} is not loopback; pass --allow-remote to load a remote server")

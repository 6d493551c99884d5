"""Zero-shot voices by id: how an id is made from a clip, and what the LM side needs of a voice.

A registered voice's id is content-addressed (`v_` + 24 hex digits of the SHA-256 of the model,
the clip's samples, its rate and transcript): registering the same clip twice gives the same id
and the same tensors, so an id is also the cache handle the detok replicas keep the tensors by.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

VOICE_ID_PREFIX = "v_"
VOICE_ID_PATTERN = re.compile(r"^v_[0-9a-f]{24}$")


def voice_id_for(model: str, pcm: bytes, sample_rate_hz: int, prompt_text: str) -> str:
    digest = hashlib.sha256()
    for part in (model.encode(), str(sample_rate_hz).encode(), prompt_text.encode(), pcm):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return VOICE_ID_PREFIX + digest.hexdigest()[:24]


def is_voice_id(name: str | None) -> bool:
    """A registered voice's id (built-in voice names never look like one)."""
    return bool(name) and VOICE_ID_PATTERN.match(name) is not None


@dataclass(frozen=True)
class SpeakerPrompt:
    """A voice as an LM with its own speaker conditioning takes it (chatterbox's T3, `speaker_emb` and
    `cond_prompt_speech_tokens`): a voice-encoder embedding of the clip and the speech tokens of its start."""

    speaker_emb: tuple[float, ...]  # [256] unit norm (float32 values)
    prompt_tokens: tuple[int, ...]  # the first 6 s's speech tokens, at most 150


@dataclass(frozen=True)
class VoicePrompt:
    """What the LM side conditions on: the clip's transcript ("" = none given) and its speech tokens
    (CosyVoice 2's LM), plus its speaker conditioning for a family whose LM takes one (else None)."""

    voice_id: str
    prompt_text: str
    prompt_tokens: tuple[int, ...]
    speaker: SpeakerPrompt | None = None

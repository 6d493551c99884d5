"""The LM-adapter contract every model family implements for the LLM engine.

An adapter formats prompts (text + voice -> token ids), owns the backbone whose forward the
engine drives, turns final hidden states into logits (optionally over a candidate subset of
the vocabulary), names its stop ids, and turns generated tokens into codec frames.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from cluster.errors import InvalidArgumentError
from cluster.types import SamplingParams
from llm_stage.models.llama import LlamaBackbone
from llm_stage.request import Request


class FrameBuilder(ABC):
    """Per-request: accumulates generated tokens, returns completed codec frames ([K] codes each)."""

    @abstractmethod
    def push(self, token_id: int) -> list[list[int]]: ...


class LMAdapter(ABC):
    """One model family's LM side. Subclasses set the class attributes and `backbone`."""

    family: str = ""
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    default_sampling: SamplingParams = SamplingParams()
    max_text_chars: int = 4000
    tokens_per_frame: int = 1  # engine steps per codec frame

    def __init__(self, backbone: LlamaBackbone) -> None:
        self.backbone = backbone

    def encode_prompt(self, text: str, voice: str | None) -> list[int]:
        """Validate text and voice, return the prompt ids."""
        if not text or not text.strip():
            raise InvalidArgumentError("text", "must not be empty")
        if len(text) > self.max_text_chars:
            raise InvalidArgumentError("text", f"longer than {self.max_text_chars} characters")
        voice = voice or self.default_voice
        if self.voices and voice not in self.voices:
            raise InvalidArgumentError("voice", f"unknown voice {voice!r}; valid voices: {', '.join(self.voices)}")
        return self.format_prompt(text, voice)

    @abstractmethod
    def format_prompt(self, text: str, voice: str | None) -> list[int]: ...

    def logits(self, hidden: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, H] -> (logits [B, C], vocab id per column [B, C] or None when C is the vocab)."""
        return hidden @ self.backbone.lm_head_weight.T, None

    @abstractmethod
    def new_frame_builder(self) -> FrameBuilder: ...

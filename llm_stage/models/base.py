"""The LM-adapter contract every model family implements for the LLM engine.

An adapter formats prompts (text + voice -> tokens), embeds a batch of positions, owns the
backbone the engine drives, turns hidden states into logits ([B, C], or [B, K, C] for K
codebooks), applies its sampling rules, decides stops, and turns steps into codec frames.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from cluster.errors import InvalidArgumentError
from cluster.types import SamplingParams
from llm_stage.cfg import GuidanceFormula
from llm_stage.models.llama import LlamaBackbone
from llm_stage.request import Request, Token

# (logits [N, C], cand ids [N, C] | None, request of each row, codebook of each row) -> sampled ids [N]
DrawFn = Callable[[torch.Tensor, torch.Tensor | None, list[Request], list[int]], list[int]]


class FrameBuilder(ABC):
    """Per-request: accumulates generated tokens, returns completed codec frames ([K] codes each)."""

    @abstractmethod
    def push(self, token_id: Token) -> list[list[int]]: ...


class LMAdapter(ABC):
    """One model family's LM side. Subclasses set the class attributes and `backbone`."""

    family: str = ""
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    default_sampling: SamplingParams = SamplingParams()
    max_text_chars: int = 4000
    num_codebooks: int = 1  # ids sampled per step; > 1 means logits are [B, K, C] and tokens are tuples
    input_width: int = 1  # lanes per position the runner hands to `embed`
    pad_token: Token = 0  # fills padded prefill positions (never attended to)
    guidance: GuidanceFormula | None = None  # CFG formula; None = the model has no CFG
    tokens_per_frame: int = 1  # engine steps per codec frame
    head_phase_period: int = 1  # steps per cycle of the output head (rows in one phase share a head matmul)

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
    def format_prompt(self, text: str, voice: str | None) -> list[Token]: ...

    def unconditional_prompt(self, text: str, voice: str | None) -> list[Token]:
        """The prompt of a guided request's hidden twin (override with `guidance`)."""
        raise InvalidArgumentError("sampling.guidance_scale", f"{self.family} has no classifier-free guidance")

    def token_lanes(self, token: Token) -> list[int]:
        """One position as `input_width` ints for the runner's [B, T, W] id tensor."""
        return [token] if isinstance(token, int) else list(token)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T, W] -> input embeddings [B, T, H]."""
        return self.backbone.embed(ids[..., 0])

    def logits(self, hidden: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, H] -> (logits [B, C] or [B, K, C], vocab id per column or None when C is the vocab)."""
        return hidden @ self.backbone.lm_head_weight.T, None

    def is_stop(self, req: Request, token: Token) -> bool:
        """Whether sampling `token` ends `req` (the token is then not appended)."""
        return token in self.eos_token_ids

    def constrain(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Model sampling rules on the (CFG-merged) logits, e.g. forced BOS / EOS per codebook."""
        return logits

    def sample_tokens(
        self, hidden: torch.Tensor, logits: torch.Tensor, cand: torch.Tensor | None, reqs: list[Request], draw: DrawFn
    ) -> list[Token]:
        """Visible rows' hidden [B, H] and merged logits -> one token per row (an int, or K ids)."""
        logits = self.constrain(logits, reqs)
        if logits.dim() == 2:
            return draw(logits, cand, reqs, [0] * len(reqs))
        num_rows, num_codebooks = logits.shape[:2]
        flat_cand = None if cand is None else cand.flatten(0, 1)
        rows = [r for r in reqs for _ in range(num_codebooks)]
        ids = draw(logits.flatten(0, 1), flat_cand, rows, list(range(num_codebooks)) * num_rows)
        return [tuple(ids[b * num_codebooks : (b + 1) * num_codebooks]) for b in range(num_rows)]

    @abstractmethod
    def new_frame_builder(self) -> FrameBuilder: ...

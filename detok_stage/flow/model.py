"""S3Gen = flow (tokens -> mel) + HiFT (mel -> wave), named as chatterbox's `s3gen.pt` (`flow.*`, `mel2wav.*`),
and the per-request streaming state that ties the two together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from detok_stage.flow.config import S3GenConfig
from detok_stage.flow.flow import CausalMaskedDiffWithXvec, Conditioning, FlowState
from detok_stage.flow.hift import HiFTGenerator, HiftState
from detok_stage.flow.weights import load_published, load_seeded


class S3Gen(nn.Module):
    def __init__(self, config: S3GenConfig) -> None:
        super().__init__()
        self.config = config
        self.flow = CausalMaskedDiffWithXvec(config)
        self.mel2wav = HiFTGenerator(config.hift, config.nsf_seed)

    @classmethod
    def seeded(cls, config: S3GenConfig, seed: int) -> S3Gen:
        """Random weights that depend only on (seed, parameter name)."""
        model = cls(config)
        load_seeded(model.flow, seed)
        load_seeded(model.mel2wav, seed + 1)
        return model.eval()

    @classmethod
    def from_checkpoint(cls, config: S3GenConfig, checkpoint: Path) -> S3Gen:
        """A CosyVoice2-0.5B directory (`flow.pt`, `hift.pt`) or chatterbox's `s3gen.pt` / `s3gen.safetensors`."""
        model = cls(config)
        load_published(model.flow, model.mel2wav, checkpoint)
        return model.eval()

    @property
    def samples_per_token(self) -> int:
        return self.config.token_mel_ratio * self.config.hift.hop

    def default_conditioning(self) -> Conditioning:
        """The voice used when a request names none: no prompt (no prompt tokens, no prompt mel) and a
        fixed x-vector drawn from `noise_seed + 1` (unit Gaussian, 192-d). With published weights this is
        an arbitrary but stable speaker; register a voice for a real one."""
        gen = torch.Generator().manual_seed(self.config.noise_seed + 1)
        return Conditioning(
            prompt_tokens=torch.zeros(self.config.default_prompt_tokens, dtype=torch.long),
            prompt_mel=torch.zeros(0, self.config.mel_bins),
            xvector=torch.randn(self.config.spk_embed_dim, generator=gen),
        )

    @torch.inference_mode()
    def offline(self, tokens: torch.Tensor, cond: Conditioning, n_timesteps: int | None = None) -> torch.Tensor:
        """tokens [B, N] -> wave [B, N * samples_per_token]: the whole utterance at once (same masks as streamed)."""
        return self.mel2wav.inference(self.flow.inference(tokens, cond, n_timesteps))

    def new_stream(self, cond: Conditioning, n_timesteps: int | None = None) -> S3GenStream:
        return S3GenStream(self.flow.new_state(cond, n_timesteps or self.config.n_timesteps), self.mel2wav.new_state())


@dataclass
class S3GenStream:
    """One request's detokenizer cache: flow (encoder + per-Euler-step estimator KV and conv state, its
    tokens) and HiFT (mel / F0 / source history, running phase)."""

    flow: FlowState
    hift: HiftState
    next_keep: int = 0  # stream token the next chunk keeps from (its keep_start)

    @property
    def nbytes(self) -> int:
        return self.flow.nbytes

"""GLM-4-Voice's detokenizer = `glm_flow` (tokens -> mel) + our `HiFTGenerator` at 22.05 kHz, and the
reference demo's block streaming (`flow_inference.AudioDecoder.token2wav`) as per-request state.

Each block is decoded with every earlier token as prompt tokens and every earlier block's returned
mel as prompt mel; its mel cross-fades (Hamming) over the last `mel_overlap_len` frames held back
from the block before, and HiFT re-reads the previous block's last mel frame with its source
samples carried. Randomness is the reference's on CPU: one generator seeded `noise_seed` per block
draws the flow noise, then HiFT's harmonic phases and source noise. Called by `GLM4VoiceCodec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from detok_stage.flow.glm_config import GLM4DecoderConfig
from detok_stage.flow.glm_flow import MaskedDiffWithXvec
from detok_stage.flow.hift import HiFTGenerator
from detok_stage.flow.weights import load_seeded

_OURS, _PUBLISHED = (
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
    (".weight_g", ".weight_v"),
)


def hift_to_published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our weight-norm names -> the published `hift.pt`'s (torch.nn.utils.weight_norm: weight_g / weight_v)."""
    out = {}
    for key, value in state.items():
        for ours, theirs in zip(_OURS, _PUBLISHED, strict=True):
            if key.endswith(ours):
                key = key[: -len(ours)] + theirs
        out[key] = value
    return out


def hift_from_published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for ours, theirs in zip(_OURS, _PUBLISHED, strict=True):
            if key.endswith(theirs):
                key = key[: -len(theirs)] + ours
        out[key] = value
    return out


@dataclass
class BlockStream:
    """One request's block-streaming state, as the demo keeps it across `token2wav` calls."""

    tokens: list[int] = field(default_factory=list)  # every token of the blocks decoded so far
    mels: list[torch.Tensor] = field(default_factory=list)  # each block's returned mel [80, n]
    mel_overlap: torch.Tensor | None = None  # [80, mel_overlap_len] held back from the last block
    cache_mel: torch.Tensor | None = None  # [80, mel_cache_len] HiFT re-reads at the next block
    cache_source: torch.Tensor | None = None  # [mel_cache_len * hop] its source samples

    @property
    def prompt_mel(self) -> torch.Tensor | None:
        return torch.cat(self.mels, dim=1) if self.mels else None


class GLM4Decoder(nn.Module):
    def __init__(self, config: GLM4DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.flow = MaskedDiffWithXvec(config)
        self.hift = HiFTGenerator(config.hift)
        self.xvector = torch.zeros(config.spk_embed_dim)  # the demo's embedding: zeros(1, 192)
        n = config.mel_overlap_len
        self.mel_window = torch.from_numpy(np.hamming(2 * n))  # float64, as the reference multiplies

    @classmethod
    def seeded(cls, config: GLM4DecoderConfig, seed: int) -> GLM4Decoder:
        """Random weights that depend only on (seed, parameter name)."""
        model = cls(config)
        load_seeded(model.flow, seed)
        load_seeded(model.hift, seed + 1)
        return model.eval()

    @classmethod
    def from_published(cls, config: GLM4DecoderConfig, directory: Path) -> GLM4Decoder:
        """`flow.pt` + `hift.pt` of a glm-4-voice-decoder directory (tensors only: weights_only)."""
        model = cls(config)
        directory = Path(directory)
        model.flow.load_state_dict(torch.load(directory / "flow.pt", map_location="cpu", weights_only=True))
        hift = torch.load(directory / "hift.pt", map_location="cpu", weights_only=True)
        model.hift.load_state_dict(hift_from_published(hift))
        return model.eval()

    def published_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(flow.pt, hift.pt) state dicts under the published names."""
        return self.flow.state_dict(), hift_to_published(self.hift.state_dict())

    @property
    def device(self) -> torch.device:
        return self.flow.input_embedding.weight.device

    # ---- HiFT with the reference's source -----------------------------------------------------

    def source(self, f0: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """f0 [1, T] -> merged NSF source [1, T * hop]: the reference's `SineGen` in float32, phase from 0,
        harmonic phases U(-pi, pi) then the noise drawn from `gen` in its order."""
        c = self.config.hift
        h = c.nb_harmonics + 1
        f0_up = f0.repeat_interleave(self.hift.hop, dim=1)[:, None].cpu()  # [1, 1, S]
        f_mat = torch.cat([f0_up * (i + 1) / c.sampling_rate for i in range(h)], dim=1)  # [1, H, S]
        theta = 2 * np.pi * (torch.cumsum(f_mat, dim=-1) % 1)
        low, high = torch.tensor(-np.pi), torch.tensor(np.pi)
        phase = low + torch.rand(1, h, 1, generator=gen) * (high - low)
        phase[:, 0, :] = 0
        sine = c.nsf_alpha * torch.sin(theta + phase)
        uv = (f0_up > c.nsf_voiced_threshold).float()
        noise_amp = uv * c.nsf_sigma + (1 - uv) * c.nsf_alpha / 3
        waves = sine * uv + noise_amp * torch.randn(sine.shape, generator=gen)
        linear = self.hift.m_source.l_linear
        return torch.tanh(linear(waves.transpose(1, 2).to(linear.weight))).transpose(1, 2)[:, 0]

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor | None,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """mel [80, T] -> (wave [T * hop], source [T * hop]); the source starts with `cache_source`."""
        x = mel[None].to(self.device)
        s = self.source(self.hift.f0_predictor(x), gen)
        if cache_source is not None and cache_source.numel():
            s[:, : cache_source.numel()] = cache_source.to(s)
        return self.hift.decode(x, s)[0], s[0]

    # ---- the demo's token2wav -----------------------------------------------------------------

    def _gen(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.config.noise_seed)

    def _mel(self, stream: BlockStream, block: list[int], gen: torch.Generator) -> torch.Tensor:
        prompt = stream.prompt_mel
        return self.flow.inference(
            torch.tensor(block, dtype=torch.long),
            torch.tensor(stream.tokens, dtype=torch.long),
            prompt if prompt is not None else torch.zeros(self.config.mel_bins, 0),
            self.xvector,
            gen,
        )

    @torch.inference_mode()
    def token2wav(self, stream: BlockStream, block: list[int], finalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode one block of a stream -> (wave [samples], the block's returned mel [80, n]); updates `stream`."""
        gen = self._gen()
        mel = self._mel(stream, block, gen)
        if stream.mel_overlap is not None:
            n = self.config.mel_overlap_len
            w = self.mel_window.to(mel.device)
            faded = mel[:, :n].double() * w[:n] + stream.mel_overlap[:, -n:].double() * w[n:]
            mel = torch.cat([faded.to(mel.dtype), mel[:, n:]], dim=1)
        if stream.cache_mel is not None:
            mel = torch.cat([stream.cache_mel, mel], dim=1)
        if finalize:
            wave, _ = self.vocode(mel, stream.cache_source, gen)
        else:
            n = self.config.mel_overlap_len
            stream.mel_overlap = mel[:, -n:]
            mel = mel[:, :-n]
            wave, source = self.vocode(mel, stream.cache_source, gen)
            keep = self.config.mel_cache_len
            stream.cache_mel = mel[:, -keep:]
            stream.cache_source = source[-keep * self.hift.hop :]
            wave = wave[: -keep * self.hift.hop]
        stream.tokens += list(block)
        stream.mels.append(mel)
        return wave, mel

    def offline(self, tokens: list[int]) -> torch.Tensor:
        """The reference's `offline_inference`: one finalized block, no prompt -> wave [samples]."""
        return self.token2wav(BlockStream(), tokens, finalize=True)[0]

    @staticmethod
    def stream_bytes(stream: BlockStream) -> int:
        """What a stream holds: its prompt mels and tokens (the rest is a few frames)."""
        return sum(m.numel() for m in stream.mels) * 4 + 8 * len(stream.tokens)

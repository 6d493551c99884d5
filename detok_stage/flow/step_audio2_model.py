"""Step-Audio 2 mini's token2wav = flow (`step_audio2_flow`) + HiFT (`step_audio2_hift`), loaded from the
published `token2wav/` directory (`flow.pt`, `hift.pt`; `campplus.onnx` and the speech tokenizer are
not run here) or seeded, and the per-stream state the codec (`detok_stage.codecs.step_audio2_codec`) keeps.

A stream starts from its voice: the prompt tokens (+ their first 3 again as look-ahead) run as one
flow call conditioned on the prompt mel, whose caches (cut) the stream continues; a voice without
prompt tokens starts from empty caches. `advance` then decodes one chunk for a group of streams
with equal cache shapes in one forward per Euler step. Each stream draws its noise from its own
generator seeded with `noise_seed`: the flow's chunk noise, then the HiFT source's draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from detok_stage.flow.flow import Conditioning
from detok_stage.flow.glm_model import hift_from_published, hift_to_published
from detok_stage.flow.hift import HiFTGenerator
from detok_stage.flow.step_audio2_config import Token2WavConfig, config_from_state
from detok_stage.flow.step_audio2_flow import FlowCache, Token2WavFlow, split_flow, stack_flow
from detok_stage.flow.step_audio2_hift import VocoderCache, empty_vocoder_cache, vocode_chunk
from detok_stage.flow.weights import load_seeded

FLOW_FILE, HIFT_FILE = "flow.pt", "hift.pt"


@dataclass
class Token2WavStream:
    """One request's detokenizer state: its x-vector, noise generator, flow and vocoder caches."""

    xvector: torch.Tensor  # [192]
    gen: torch.Generator
    flow: FlowCache | None  # None before any flow call (a voice without prompt tokens)
    vocoder: VocoderCache

    @property
    def shape_key(self) -> tuple:
        return (None if self.flow is None else self.flow.shape_key, self.vocoder.shape_key)

    @property
    def nbytes(self) -> int:
        return 0 if self.flow is None else self.flow.nbytes

    def copy(self) -> Token2WavStream:
        """An independent stream from this state (caches are never written in place; the generator is copied)."""
        gen = torch.Generator().set_state(self.gen.get_state())
        return Token2WavStream(self.xvector, gen, self.flow, self.vocoder)


class StepAudio2Token2Wav(nn.Module):
    def __init__(self, config: Token2WavConfig) -> None:
        super().__init__()
        self.config = config
        self.flow = Token2WavFlow(config)
        self.hift = HiFTGenerator(config.hift)

    @classmethod
    def seeded(cls, config: Token2WavConfig, seed: int) -> StepAudio2Token2Wav:
        """Random weights that depend only on (seed, parameter name)."""
        model = cls(config)
        load_seeded(model.flow, seed)
        load_seeded(model.hift, seed + 1)
        return model.eval()

    @classmethod
    def from_published(cls, directory: Path, **overrides) -> StepAudio2Token2Wav:
        """A token2wav/ directory: shapes read from the weights (`config_from_state`), loaded strictly."""
        flow = torch.load(Path(directory) / FLOW_FILE, map_location="cpu", weights_only=True)
        hift = hift_from_published(
            {k.removeprefix("generator."): v
             for k, v in torch.load(Path(directory) / HIFT_FILE, map_location="cpu", weights_only=True).items()}
        )  # fmt: skip
        model = cls(config_from_state(flow, hift, **overrides))
        model.flow.load_state_dict(flow, strict=True)
        model.hift.load_state_dict(hift, strict=True)
        return model.eval()

    def published_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(flow.pt, hift.pt) as published: HiFT's weight norm as weight_g / weight_v."""
        return dict(self.flow.state_dict()), hift_to_published(dict(self.hift.state_dict()))

    @property
    def device(self) -> torch.device:
        return self.flow.input_embedding.weight.device

    def default_conditioning(self) -> Conditioning:
        """The voice of a request that names none: `default_prompt_tokens` seeded prompt tokens, their
        seeded mel, and a seeded x-vector (all from `noise_seed + 1`). With published weights
        (no prompt) an arbitrary but stable speaker; register a voice for a real one."""
        c = self.config
        gen = torch.Generator().manual_seed(c.noise_seed + 1)
        tokens = torch.randint(0, c.vocab_size, (c.default_prompt_tokens,), generator=gen)
        mel = torch.randn(c.token_mel_ratio * c.default_prompt_tokens, c.mel_bins, generator=gen)
        return Conditioning(tokens, mel, torch.randn(c.spk_embed_dim, generator=gen))

    # ---- streaming ------------------------------------------------------------------------------

    @torch.inference_mode()
    def new_stream(self, cond: Conditioning) -> Token2WavStream:
        """A stream conditioned on `cond`: its prompt run as the first flow call (the published `setup_cache`)."""
        gen = torch.Generator().manual_seed(self.config.noise_seed)
        stream = Token2WavStream(cond.xvector.float().to(self.device), gen, None,
                                 empty_vocoder_cache(self.config.mel_bins, self.device))  # fmt: skip
        prompt = cond.prompt_tokens.reshape(-1).tolist()
        if not prompt:
            return stream
        lookahead = (prompt * self.config.pre_lookahead_len)[: self.config.pre_lookahead_len]
        tokens = torch.tensor([prompt + lookahead], device=self.device)
        mel = cond.prompt_mel.float().T.unsqueeze(0).to(self.device)  # [1, 80, 2P]
        _, stream.flow = self.flow(tokens, stream.xvector[None], self._noise([gen], mel.shape[2]), None, cond=mel)
        return stream

    @torch.inference_mode()
    def advance(self, streams: list[Token2WavStream], tokens: list[list[int]], last_chunk: bool
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
        """One chunk for streams of equal `shape_key`: tokens per stream, equal lengths (T kept + 3
        look-ahead, or T with `last_chunk`) -> (mel [80, 2T], audio) per stream; their states advance."""
        c = self.config
        kept = len(tokens[0]) - (0 if last_chunk else c.pre_lookahead_len)
        gens = [s.gen for s in streams]
        cache = None if streams[0].flow is None else stack_flow([s.flow for s in streams])
        xvectors = torch.stack([s.xvector for s in streams])
        ids = torch.tensor(tokens, device=self.device)
        mel, cache = self.flow(ids, xvectors, self._noise(gens, c.token_mel_ratio * kept), cache, last_chunk)
        audio, vocoders = vocode_chunk(self.hift, mel, [s.vocoder for s in streams], gens, last_chunk,
                                       c.mel_cache_frames)  # fmt: skip
        for stream, flow, vocoder in zip(streams, split_flow(cache), vocoders, strict=True):
            stream.flow, stream.vocoder = flow, vocoder
        return list(mel), audio

    def _noise(self, gens: list[torch.Generator], frames: int) -> torch.Tensor:
        """Each stream's chunk noise [1, 80, frames] from its generator (the published `torch.randn` call)."""
        draws = [torch.randn(1, self.config.mel_bins, frames, generator=g) for g in gens]
        return torch.cat(draws).to(self.device)

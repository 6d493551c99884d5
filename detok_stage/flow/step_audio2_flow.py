"""Step-Audio 2's token -> mel flow (`CausalMaskedDiffWithXvec` of its token2wav/), one streamed call at a
time over a batch of requests whose caches have the same shapes. Called by
`detok_stage.flow.step_audio2_model`.

A call embeds the chunk's tokens (T kept + 3 look-ahead; a last chunk pads zeros instead), runs the
V2 encoder from its cache, projects to 80 mels (mu), and solves the CFM in `n_timesteps` Euler steps
on a cosine t schedule from the chunk's noise, each step one DiT forward over the batch doubled for
CFG (rows [cond..., uncond...]: the second half with mu, speaker and condition zeroed), each Euler
step continuing its own estimator caches. The prompt is run once as a call of its own, with its
mel as the condition (`cond` zeros afterwards). After every call each attention cache is cut to its
last `att_cache_frames` positions (`FlowCache.cut`), as the published streaming does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.flow.step_audio2_config import Token2WavConfig
from detok_stage.flow.step_audio2_dit import DiT
from detok_stage.flow.step_audio2_encoder import EncoderCache, UpsampleConformerEncoderV2, split_encoder, stack_encoder


class CausalConditionalCFM(nn.Module):
    """Holds the estimator under the published name `decoder.estimator`."""

    def __init__(self, estimator: DiT) -> None:
        super().__init__()
        self.estimator = estimator


@dataclass(frozen=True)
class FlowCache:
    """One request's (or a batch's) flow caches. The estimator's rows are the CFG pair of each request:
    [cond rows of the batch, then their uncond rows] (one request: [cond, uncond])."""

    encoder: EncoderCache
    est_conv: torch.Tensor  # [steps, depth, 2N, 2C, 2]
    est_att: torch.Tensor  # [steps, depth, 2N, H, L, 2 d]

    def cut(self, limit: int) -> FlowCache:
        """The published cut: every attention cache to its last `limit` positions (the encoder's as its
        tiled storage makes it, see `EncoderCache.cut`; the estimator's keep the oldest, see `step_audio2_dit`)."""
        return FlowCache(self.encoder.cut(limit), self.est_conv, self.est_att[:, :, :, :, -limit:])

    @property
    def shape_key(self) -> tuple[int, int]:
        """What must match for requests to share a forward: the encoder's and the estimator's cache lengths."""
        return self.encoder.length, self.est_att.shape[4]

    @property
    def nbytes(self) -> int:
        enc = self.encoder
        tensors = (enc.look, enc.up, enc.att1, enc.att2, self.est_conv, self.est_att)
        return sum(t.numel() * t.element_size() for t in tensors)


def _cfg_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-request [steps, depth, 2, ...] caches -> the batch's [steps, depth, 2N, ...]: conds, then unconds."""
    return torch.cat([t[:, :, :1] for t in tensors] + [t[:, :, 1:] for t in tensors], dim=2)


def stack_flow(caches: list[FlowCache]) -> FlowCache:
    return FlowCache(
        stack_encoder([c.encoder for c in caches]), _cfg_rows([c.est_conv for c in caches]),
        _cfg_rows([c.est_att for c in caches]),
    )  # fmt: skip


def split_flow(cache: FlowCache) -> list[FlowCache]:
    n = cache.est_att.shape[2] // 2

    def pair(t: torch.Tensor, i: int) -> torch.Tensor:
        return torch.cat([t[:, :, i : i + 1], t[:, :, n + i : n + i + 1]], dim=2)

    return [
        FlowCache(enc, pair(cache.est_conv, i), pair(cache.est_att, i))
        for i, enc in enumerate(split_encoder(cache.encoder))
    ]


class Token2WavFlow(nn.Module):
    def __init__(self, config: Token2WavConfig) -> None:
        super().__init__()
        self.config = config
        self.input_embedding = nn.Embedding(config.vocab_size, config.encoder.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.mel_bins)
        self.encoder = UpsampleConformerEncoderV2(config.encoder)
        self.encoder_proj = nn.Linear(config.encoder.output_size, config.mel_bins)
        self.decoder = CausalConditionalCFM(DiT(config.estimator))

    def t_span(self, device: torch.device) -> torch.Tensor:
        t = torch.linspace(0, 1, self.config.n_timesteps + 1, device=device)
        return 1 - torch.cos(t * 0.5 * torch.pi)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, xvectors: torch.Tensor, noise: torch.Tensor, cache: FlowCache | None,
                last_chunk: bool = False, cond: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, FlowCache]:  # fmt: skip
        """tokens [N, T + 3] (or [N, T] with `last_chunk`), xvectors [N, 192], noise [N, 80, 2T], `cond`
        [N, 80, 2T] (the prompt's mel; zeros when None) -> (mel [N, 80, 2T], the caches after, cut)."""
        spks = self.spk_embed_affine_layer(F.normalize(xvectors, dim=1))
        h, encoder = self.encoder(self.input_embedding(tokens.clamp(min=0)), last_chunk, cache and cache.encoder)
        mu = self.encoder_proj(h).transpose(1, 2)  # [N, 80, 2T]
        cond = torch.zeros_like(mu) if cond is None else cond
        mel, est_conv, est_att = self._solve(noise, mu, spks, cond, cache)
        return mel, FlowCache(encoder, est_conv, est_att).cut(self.config.att_cache_frames)

    def _solve(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
               cache: FlowCache | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Euler steps with CFG; each step's estimator continues its own caches -> (x, conv caches, att caches)."""
        estimator, rate = self.decoder.estimator, self.config.cfg_rate
        frames = mu.shape[2]
        condition = torch.cat([
            torch.cat([mu, spks.unsqueeze(2).expand(-1, -1, frames), cond], dim=1),
            torch.zeros(mu.shape[0], mu.shape[1] + spks.shape[1] + cond.shape[1], frames, device=mu.device),
        ])  # fmt: skip
        t_span = self.t_span(mu.device)
        t, dt = t_span[0].unsqueeze(0), t_span[1] - t_span[0]
        convs, atts = [], []
        for step in range(1, len(t_span)):
            inputs = torch.cat([x.repeat(2, 1, 1), condition], dim=1)  # [2N, 320, 2T]
            conv = None if cache is None else cache.est_conv[step - 1]
            att = None if cache is None else cache.est_att[step - 1]
            velocity, conv, att = estimator(inputs, t.repeat(inputs.shape[0]), conv, att)
            guided, unguided = velocity.chunk(2, dim=0)
            x = x + dt * ((1.0 + rate) * guided - rate * unguided)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
            convs.append(conv)
            atts.append(att)
        return x, torch.stack(convs), torch.stack(atts)

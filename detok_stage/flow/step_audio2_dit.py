"""Step-Audio 2's flow estimator: a DiT (`decoder_dit.DiT` of stepfun-ai/Step-Audio2) streamed chunk by
chunk with per-block caches. Used by `detok_stage.flow.step_audio2_flow` once per Euler step.

Input per frame: x, mu, the speaker and the prompt-mel condition (80 each) -> `in_proj` -> blocks of
adaLN-Zero (9 modulations from the timestep embedding: attention, MLP, conv) with qk-LayerNorm
attention and a causal conv block (conv k3, LayerNorm, Mish, conv k3) -> `final_layer`. No position
encoding and no mask: a chunk attends to every cached key and to all of itself. As published, a
chunk's new keys are put BEFORE the cached ones (`[new, cached]`): attention does not see the order,
but the 128-position cut (`trim`) keeps the oldest positions of that list, so once full, the cache
stops taking new frames. Parameter names follow the published `flow.pt` (`decoder.estimator.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.flow.step_audio2_config import DiTConfig


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, frequency_dim: int, scale: float) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.frequency_dim = frequency_dim
        self.scale = scale

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t [N] in [0, 1] -> [N, hidden]: a (cos, sin) sinusoid of t * scale, periods up to 10000."""
        half = self.frequency_dim // 2
        t = t * self.scale
        freqs = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(half, dtype=t.dtype) / half).to(t.device)
        args = t[:, None] * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.to_q = nn.Linear(hidden, inner)
        self.to_k = nn.Linear(hidden, inner)
        self.to_v = nn.Linear(hidden, inner)
        self.q_norm = nn.LayerNorm(head_dim)
        self.k_norm = nn.LayerNorm(head_dim)
        self.proj = nn.Linear(inner, hidden)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)  # [N, H, T, d]

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, T, C], cache [N, H, L, 2d] (keys then values) -> (out [N, T, C], cache [N, H, T + L, 2d])."""
        q = self.q_norm(self._heads(self.to_q(x)))
        k = self.k_norm(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        if cache is not None:
            k_cached, v_cached = cache.chunk(2, dim=3)
            k, v = torch.cat([k, k_cached], dim=2), torch.cat([v, v_cached], dim=2)  # new first, as published
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        return self.proj(out), torch.cat([k, v], dim=3)


class CausalConvBlock(nn.Module):
    """conv k3 -> LayerNorm -> Mish -> conv k3, both convs causal (their 2 left inputs carried).
    Held in a Sequential at the published indices (`block.1`, `block.3`, `block.6`; the others were
    transposes)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels
        self.block = nn.Sequential(
            nn.Identity(), nn.Conv1d(channels, channels, 3), nn.Identity(), nn.LayerNorm(channels), nn.Mish(),
            nn.Identity(), nn.Conv1d(channels, channels, 3), nn.Identity(),
        )  # fmt: skip

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, T, C], cache [N, 2C, 2] (each conv's last two inputs) -> (out [N, T, C], cache)."""
        left1, left2 = (None, None) if cache is None else cache.split(self.channels, dim=1)
        h, new1 = _causal(self.block[1], x.transpose(1, 2), left1)
        h = self.block[4](self.block[3](h.transpose(1, 2)))
        h, new2 = _causal(self.block[6], h.transpose(1, 2), left2)
        return h.transpose(1, 2), torch.cat([new1, new2], dim=1)


def _causal(conv: nn.Conv1d, x: torch.Tensor, left: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel-3 conv over x [N, C, T] after its 2 carried left inputs (zeros at the start)."""
    if left is None:
        left = x.new_zeros(x.shape[0], x.shape[1], 2)
    x = torch.cat([left, x], dim=2)
    return conv(x), x[..., -2:]


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(h, config.num_heads, config.head_dim)
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(h, config.mlp_hidden)
        self.norm3 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.conv = CausalConvBlock(h)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(h, 9 * h))

    def forward(self, x: torch.Tensor, c: torch.Tensor, conv_cache: torch.Tensor | None,
                att_cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [N, T, C], c [N, 1, C] (timestep) -> (x, conv cache, attention cache)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_conv, scale_conv, gate_conv = (
            self.adaLN_modulation(c).chunk(9, dim=-1)
        )
        attended, att_cache = self.attn(modulate(self.norm1(x), shift_msa, scale_msa), att_cache)
        x = x + gate_msa * attended
        convolved, conv_cache = self.conv(modulate(self.norm3(x), shift_conv, scale_conv), conv_cache)
        x = x + gate_conv * convolved
        x = x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x, conv_cache, att_cache


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int) -> None:
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, out_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        self.t_embedder = TimestepEmbedder(config.hidden_size, config.frequency_embedding_size, config.time_scale)
        self.in_proj = nn.Linear(config.in_channels, config.hidden_size)
        self.blocks = nn.ModuleList([DiTBlock(config) for _ in range(config.depth)])
        self.final_layer = FinalLayer(config.hidden_size, config.out_channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor, conv_cache: torch.Tensor | None,
                att_cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [N, in_channels, T] (x, mu, speaker, cond stacked), t [N]; caches [depth, N, ...] or None
        -> (velocity [N, out_channels, T], conv caches [depth, N, 2C, 2], attention caches [depth, N, H, L + T, 2d])."""
        c = self.t_embedder(t).unsqueeze(1)  # [N, 1, C]
        h = self.in_proj(x.transpose(1, 2))
        convs, atts = [], []
        for i, block in enumerate(self.blocks):
            h, conv, att = block(h, c, None if conv_cache is None else conv_cache[i],
                                 None if att_cache is None else att_cache[i])  # fmt: skip
            convs.append(conv)
            atts.append(att)
        return self.final_layer(h, c).transpose(1, 2), torch.stack(convs), torch.stack(atts)

"""Step-Audio 2's flow encoder (`UpsampleConformerEncoderV2`), streamed chunk by chunk with caches.

Embedded tokens (25 Hz) -> `embed` (linear + layer norm, x sqrt(d)) -> `pre_lookahead_layer` (sees 3
tokens ahead; its causal conv's 2 left inputs carried) -> `encoders` (rel-pos conformer blocks) ->
`up_layer` (x2 nearest + causal conv, 4 left inputs carried) -> `up_embed` -> `up_encoders` at 50 Hz ->
`after_norm`. No mask inside a chunk: it attends to every cached key/value and all of itself, with
relative positions counted along [cached, new]. The blocks are `detok_stage.flow.encoder`'s (same
parameters and math; only the caching differs), so names follow the published `flow.pt`.

The published cache holds both stages in one tensor at the 50 Hz length: the 25 Hz stage's keys
tiled x2 along time (`[c, c]`), read back as the first half. `trim` reproduces what that does under
the 128-position cut (`EncoderCache.cut`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.flow.config import EncoderConfig
from detok_stage.flow.encoder import ConformerEncoderLayer, LinearEmbed, PreLookaheadLayer, Upsample1D


@dataclass(frozen=True)
class EncoderCache:
    """A batch's encoder caches (rows = requests): the convs' left inputs and each block's keys/values."""

    look: torch.Tensor  # [N, D, 2] inputs of the pre-lookahead layer's causal conv
    up: torch.Tensor  # [N, D, 4] inputs of the up layer's conv
    att1: torch.Tensor  # [num_blocks, N, H, L, 2 d_k] the 25 Hz blocks' keys then values
    att2: torch.Tensor  # [num_up_blocks, N, H, 2L, 2 d_k] the 50 Hz blocks'

    def cut(self, limit: int) -> EncoderCache:
        """The cache the published code reads next after cutting its stored tensor to the last `limit`
        positions. That tensor is [att1 tiled x2 along time; att2], both 2L long: att2 keeps its last
        `limit` keys (a sliding window); att1 is read as the first half of the cut tiling. Until
        2L > limit that is att1 itself; past it, it is NOT att1's last limit / 2 keys: with L >= limit it
        is att1[L - limit : L - limit / 2] (the newest limit / 2 keys are skipped), in between the tail
        att1[2L - limit :] followed by the head att1[: L - limit / 2]. Relative positions are then
        counted along that list as if it were contiguous. We reproduce it as the reference computes it."""
        tiled = torch.cat([self.att1, self.att1], dim=3)[:, :, :, -limit:]
        return EncoderCache(self.look, self.up, tiled[:, :, :, : tiled.shape[3] // 2], self.att2[:, :, :, -limit:])

    @property
    def length(self) -> int:
        return self.att2.shape[3]


def stack_encoder(caches: list[EncoderCache]) -> EncoderCache:
    return EncoderCache(
        torch.cat([c.look for c in caches]), torch.cat([c.up for c in caches]),
        torch.cat([c.att1 for c in caches], dim=1), torch.cat([c.att2 for c in caches], dim=1),
    )  # fmt: skip


def split_encoder(cache: EncoderCache) -> list[EncoderCache]:
    return [
        EncoderCache(cache.look[i : i + 1], cache.up[i : i + 1], cache.att1[:, i : i + 1], cache.att2[:, i : i + 1])
        for i in range(cache.look.shape[0])
    ]


class UpsampleConformerEncoderV2(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        d = config.output_size
        if config.input_size != d:
            raise ValueError("up_embed is Linear(input_size, output_size) over encoder outputs: the sizes must match")
        self.embed = LinearEmbed(config.input_size, d)
        self.pre_lookahead_layer = PreLookaheadLayer(d, config.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            [ConformerEncoderLayer(d, config.attention_heads, config.linear_units) for _ in range(config.num_blocks)]
        )
        self.up_layer = Upsample1D(d, d, config.up_stride)
        self.up_embed = LinearEmbed(config.input_size, d)
        self.up_encoders = nn.ModuleList(
            [ConformerEncoderLayer(d, config.attention_heads, config.linear_units) for _ in range(config.num_up_blocks)]
        )
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def forward(self, emb: torch.Tensor, last_chunk: bool, cache: EncoderCache | None
                ) -> tuple[torch.Tensor, EncoderCache]:  # fmt: skip
        """emb [N, T + 3, D] (T tokens then their 3 look-ahead ones; with `last_chunk`, [N, T, D], the
        look-ahead zeros after the embedding) -> (h [N, 2T, D], the uncut cache after the chunk)."""
        xs = self.embed(emb)
        if last_chunk:
            xs = F.pad(xs, (0, 0, 0, self.config.pre_lookahead_len))
        xs, look = self._pre_lookahead(xs, None if cache is None else cache.look)
        att1 = []
        for i, layer in enumerate(self.encoders):
            xs, kv = _block(layer, xs, None if cache is None else cache.att1[i])
            att1.append(kv)
        xs, up = self._upsample(xs, None if cache is None else cache.up)
        xs = self.up_embed(xs)
        att2 = []
        for i, layer in enumerate(self.up_encoders):
            xs, kv = _block(layer, xs, None if cache is None else cache.att2[i])
            att2.append(kv)
        return self.after_norm(xs), EncoderCache(look, up, torch.stack(att1), torch.stack(att2))

    def _pre_lookahead(self, xs: torch.Tensor, left: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.pre_lookahead_layer
        h = F.leaky_relu(layer.conv1(xs.transpose(1, 2)))  # [N, D, T]: each token with its 3 ahead
        if left is None:
            left = h.new_zeros(h.shape[0], h.shape[1], 2)
        h = torch.cat([left, h], dim=2)
        return layer.conv2(h).transpose(1, 2) + xs[:, : -layer.pre_lookahead_len], h[..., -2:]

    def _upsample(self, xs: torch.Tensor, left: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        stride = self.up_layer.stride
        up = F.interpolate(xs.transpose(1, 2), scale_factor=float(stride), mode="nearest")
        if left is None:
            left = up.new_zeros(up.shape[0], up.shape[1], 2 * stride)
        up = torch.cat([left, up], dim=2)
        return self.up_layer.conv(up).transpose(1, 2), up[..., -2 * stride :]


def _block(layer: ConformerEncoderLayer, x: torch.Tensor, cache: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One pre-norm conformer block over x [N, T, D] after `cache` [N, H, L, 2 d_k] (keys then values):
    queries sit at positions L..L+T-1 of [cached, new], with no mask -> (x, cache [N, H, L + T, 2 d_k])."""
    att = layer.self_attn
    h = layer.norm_mha(x)
    q, k, v = att._split(att.linear_q(h)), att._split(att.linear_k(h)), att._split(att.linear_v(h))
    if cache is not None:
        k_cached, v_cached = cache.split(att.d_k, dim=-1)
        k, v = torch.cat([k_cached, k], dim=2), torch.cat([v_cached, v], dim=2)
    n, t, keys = x.shape[0], x.shape[1], k.shape[2]
    qpos = torch.arange(keys - t, keys, device=x.device)
    rel = (qpos.unsqueeze(1) - torch.arange(keys, device=x.device).unsqueeze(0)).unsqueeze(0)  # [1, T, L + T]
    visible = torch.ones(1, 1, t, keys, dtype=torch.bool, device=x.device)
    out = att._attend(q, k, v, rel, (1 - t, keys - 1), visible)
    x = x + att.linear_out(out.transpose(1, 2).reshape(n, t, att.h * att.d_k))
    return x + layer.feed_forward(layer.norm_ff(x)), torch.cat([k, v], dim=-1)

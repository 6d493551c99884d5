"""The flow-matching estimator (`CausalConditionalDecoder`): a one-level causal U-Net over mel frames.

in: x, mu, speaker, prompt-mel condition (4 x 80 channels) and the Euler time t ->
down (causal resnet + transformer blocks + causal conv) -> mid blocks -> up (skip concat, resnet,
transformers, causal conv) -> final causal block -> 80 channels. Every conv is causal (kernel 3,
two frames of left context) and every attention is chunk-causal over `chunk` frames (reading every
earlier frame, or a bounded history: `detok_stage.flow.slots.EstimatorHistory`), so a streamed
chunk needs only each conv's last two input frames and each block's keys/values, kept per Euler
step in the request's slot (`detok_stage.flow.slots`). Parameter names follow the published
`flow.pt` (`decoder.estimator.*`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.flow.attention import AttnCall, chunk_mask
from detok_stage.flow.config import EstimatorConfig
from detok_stage.flow.slots import EstimatorHistory, SlotBatch


class StreamCtx:
    """What one estimator forward needs besides its input: the attention chunk and the frames it may
    read (`history`; streamed, the batch's keys already say so) and, streamed, the requests' slots
    (`batch`, rows grouped per request: R = 2 with CFG) and which Euler step this is (each step keeps
    its own keys, values and conv inputs); offline `batch` is None."""

    def __init__(self, chunk: int, batch: SlotBatch | None = None, step: int = 0,
                 history: EstimatorHistory | None = None) -> None:  # fmt: skip
        self.chunk = chunk
        self.history = history
        self.batch = batch
        self.step = step
        self.call = AttnCall(batch, ("estimator", step))
        self.block_index = 0

    def causal_conv(self, conv: nn.Conv1d, x: torch.Tensor, name: str) -> torch.Tensor:
        width = conv.kernel_size[0] - 1
        if self.batch is None:
            return conv(F.pad(x, (width, 0)))
        return conv(self.batch.conv_left(f"estimator.{self.step}.{name}", x, width))

    def next_layer(self) -> tuple:
        i = self.block_index
        self.block_index += 1
        return self.call.layer(i)


class Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        # indices as published: 0 conv, 1/3 transposes, 2 layer norm, 4 mish
        self.block = nn.Sequential(
            nn.Conv1d(dim, dim_out, 3), Transpose(), nn.LayerNorm(dim_out), Transpose(), nn.Mish()
        )

    def forward(self, x: torch.Tensor, ctx: StreamCtx, name: str) -> torch.Tensor:
        h = ctx.causal_conv(self.block[0], x, name)
        return F.mish(self.block[2](h.transpose(1, 2)).transpose(1, 2))


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, ctx: StreamCtx, name: str) -> torch.Tensor:
        h = self.block1(x, ctx, name + ".block1")
        h = h + self.mlp(t).unsqueeze(-1)
        h = self.block2(h, ctx, name + ".block2")
        return h + self.res_conv(x)


class Attention(nn.Module):
    """diffusers' `Attention` as the published block uses it: no q/k/v bias, `to_out.0` with bias."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])

    def forward(self, x: torch.Tensor, ctx: StreamCtx, layer: tuple) -> torch.Tensor:
        n, t, _ = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.heads, self.dim_head).transpose(1, 2)

        q, k, v = split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x))
        if ctx.batch is None:
            pos = torch.arange(t, device=x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk_mask(pos, pos, ctx.chunk, ctx.history))
        else:
            keys, values = ctx.batch.keys_values(layer, k, v)
            mask = ctx.batch.mask_rows(n // ctx.batch.num_requests)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.to_out[0](out.transpose(1, 2).reshape(n, t, self.heads * self.dim_head))


class GELUProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.ModuleList([GELUProj(dim, dim * mult), nn.Dropout(0.0), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, dim_head)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, ctx: StreamCtx) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), ctx, ctx.next_layer())
        return x + self.ff(self.norm3(x))


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels: int, time_embed_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def sinusoidal_embedding(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angle = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((angle.sin(), angle.cos()), dim=-1)


class CausalConditionalDecoder(nn.Module):
    def __init__(self, config: EstimatorConfig) -> None:
        super().__init__()
        self.config = config
        c = config.channels
        tdim = c * 4
        self.time_mlp = TimestepEmbedding(config.in_channels, tdim)

        def blocks() -> nn.ModuleList:
            return nn.ModuleList(
                [BasicTransformerBlock(c, config.num_heads, config.attention_head_dim) for _ in range(config.n_blocks)]
            )

        self.down_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock1D(config.in_channels, c, tdim), blocks(), nn.Conv1d(c, c, 3)])]
        )
        self.mid_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock1D(c, c, tdim), blocks()]) for _ in range(config.num_mid_blocks)]
        )
        self.up_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock1D(2 * c, c, tdim), blocks(), nn.Conv1d(c, c, 3)])]
        )
        self.final_block = CausalBlock1D(c, c)
        self.final_proj = nn.Conv1d(c, config.out_channels, 1)

    @property
    def num_attention_blocks(self) -> int:
        return self.config.n_blocks * (2 + self.config.num_mid_blocks)

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                ctx: StreamCtx) -> torch.Tensor:  # fmt: skip
        """x, mu, cond [N, 80, T]; t [N]; spks [N, 80] -> velocity [N, 80, T]."""
        temb = self.time_mlp(sinusoidal_embedding(t, self.config.in_channels).to(t.dtype))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1)
        ctx.block_index = 0

        def transformers(h: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
            h = h.transpose(1, 2)
            for block in blocks:
                h = block(h, ctx)
            return h.transpose(1, 2)

        resnet, tblocks, down = self.down_blocks[0]
        h = transformers(resnet(h, temb, ctx, "down.resnet"), tblocks)
        skip = h
        h = ctx.causal_conv(down, h, "down.conv")
        for i, (resnet, tblocks) in enumerate(self.mid_blocks):
            h = transformers(resnet(h, temb, ctx, f"mid{i}.resnet"), tblocks)
        resnet, tblocks, up = self.up_blocks[0]
        h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)
        h = transformers(resnet(h, temb, ctx, "up.resnet"), tblocks)
        h = ctx.causal_conv(up, h, "up.conv")
        h = self.final_block(h, ctx, "final")
        return self.final_proj(h)

"""The flow's `UpsampleConformerEncoder` (CosyVoice 2 / S3Gen), chunk-causal and streamable.

Tokens (25 Hz) -> `embed` (linear + layer norm, x sqrt(d)) -> `pre_lookahead_layer` (a conv that sees
3 tokens ahead, then a causal conv) -> `encoders` (rel-pos conformer blocks, chunk mask of
`chunk` tokens) -> `up_layer` (x2 nearest + causal conv) -> `up_embed` -> `up_encoders` (chunk mask
of 2 x chunk frames) -> `after_norm`. Parameter names follow the published `flow.pt` (`encoder.*`).

Streamed, a request's chunk of T tokens comes with the 3 look-ahead tokens after it (zeros past the
stream's end, as offline); its state holds each block's keys/values and the two causal convs' left inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.flow.attention import AttnCall, chunk_mask
from detok_stage.flow.config import EncoderConfig
from detok_stage.flow.slots import SlotBatch


def rel_pos_encoding(rel: torch.Tensor, d_model: int) -> torch.Tensor:
    """ESPnet's relative encoding of distances `rel` (query - key): [R, d] with sin/cos interleaved."""
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    angle = rel.to(torch.float32).unsqueeze(1) * div.to(rel.device)
    pe = torch.empty(rel.shape[0], d_model, device=rel.device)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe


class RelPositionMultiHeadedAttention(nn.Module):
    def __init__(self, n_head: int, n_feat: int) -> None:
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_head, self.d_k))

    def _projected_positions(self, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """linear_pos(encoding(r)) for r in [lo, hi] as [H, R, d]; kept (and grown) across calls, so a
        streamed chunk does not re-project every distance back to the stream's start."""
        weight = self.linear_pos.weight
        key = (weight.data_ptr(), weight._version, device)
        cache = getattr(self, "_pos_cache", None)
        if cache is None or cache[0] != key or lo < cache[1] or hi > cache[2]:
            old_lo, old_hi = (cache[1], cache[2]) if cache is not None and cache[0] == key else (-64, 64)
            c_lo = old_lo if lo >= old_lo else 2 * lo  # grow the side that ran out, with room
            c_hi = old_hi if hi <= old_hi else 2 * hi
            table = torch.arange(c_lo, c_hi + 1, device=device)
            with torch.no_grad():
                proj = self.linear_pos(rel_pos_encoding(table, self.h * self.d_k))
            cache = (key, c_lo, c_hi, proj.view(-1, self.h, self.d_k).transpose(0, 1))
            if getattr(self, "_pos_cache", None) is not None:  # a CUDA graph may still read the old table
                self._replaced_pos_tables = [*getattr(self, "_replaced_pos_tables", []), self._pos_cache[3]]
            self._pos_cache = cache
        return cache[3][:, lo - cache[1] : hi - cache[1] + 1]

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.h, self.d_k).transpose(1, 2)  # [N, H, T, d]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: torch.Tensor, span: tuple[int, int],
                visible: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """q [n, H, Tq, d], k/v [n, H, Tk, d]; rel [n or 1, Tq, Tk] query minus key positions, all within
        `span` (lo, hi); visible [n or 1, 1, Tq, Tk] -> [n, H, Tq, d]."""
        lo, hi = span
        p = self._projected_positions(lo, hi, q.device)
        ac = torch.matmul(q + self.pos_bias_u.unsqueeze(1), k.transpose(-2, -1))
        bd_all = torch.matmul(q + self.pos_bias_v.unsqueeze(1), p.transpose(-2, -1))  # [n, H, Tq, R]
        index = (rel - lo).unsqueeze(1).expand(q.shape[0], self.h, -1, -1)
        bd = torch.gather(bd_all, -1, index)
        scores = (ac + bd) / math.sqrt(self.d_k)
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    def forward(self, x: torch.Tensor, call: AttnCall, layer: tuple, chunk: int) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = self._split(self.linear_q(x)), self._split(self.linear_k(x)), self._split(self.linear_v(x))
        if call.batch is None:
            pos = torch.arange(t, device=x.device)
            rel = (pos.unsqueeze(1) - pos.unsqueeze(0)).unsqueeze(0)
            out = self._attend(q, k, v, rel, (1 - t, t - 1), chunk_mask(pos, pos, chunk).view(1, 1, t, t))
        else:
            batch = call.batch
            keys, values = batch.keys_values(layer, k, v)  # [G, H, L, d]: one row per request
            kpos = torch.arange(batch.num_keys, device=x.device)
            rel = batch.query_positions.unsqueeze(2) - kpos.view(1, 1, -1)  # [G, t, L]
            span = batch.span or (1 - batch.num_keys, batch.num_keys - 1)  # positions lie in [0, L)
            out = self._attend(q, keys, values, rel, span, batch.visible)
        return self.linear_out(out.transpose(1, 2).reshape(n, t, self.h * self.d_k))


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden)
        self.w_2 = nn.Linear(hidden, idim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerEncoderLayer(nn.Module):
    """Pre-norm self-attention + feed-forward (the published flow has no conv module, no macaron FF)."""

    def __init__(self, size: int, heads: int, linear_units: int) -> None:
        super().__init__()
        self.self_attn = RelPositionMultiHeadedAttention(heads, size)
        self.feed_forward = PositionwiseFeedForward(size, linear_units)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)

    def forward(self, x: torch.Tensor, call: AttnCall, layer: tuple, chunk: int) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), call, layer, chunk)
        return x + self.feed_forward(self.norm_ff(x))


class LinearEmbed(nn.Module):
    """`LinearNoSubsampling` + `EspnetRelPositionalEncoding`'s x sqrt(d) (the encodings are made in attention)."""

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class PreLookaheadLayer(nn.Module):
    def __init__(self, channels: int, pre_lookahead_len: int) -> None:
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)


class Upsample1D(nn.Module):
    def __init__(self, channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, out_channels, stride * 2 + 1)


@dataclass(frozen=True)
class EncoderBatch:
    """A streamed encoder forward's requests: their token positions (25 Hz blocks, the convs' left
    inputs) and mel-frame positions (50 Hz blocks)."""

    tokens: SlotBatch
    frames: SlotBatch


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        d = config.output_size
        self.embed = LinearEmbed(config.input_size, d)
        self.pre_lookahead_layer = PreLookaheadLayer(d, config.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            [ConformerEncoderLayer(d, config.attention_heads, config.linear_units) for _ in range(config.num_blocks)]
        )
        self.up_layer = Upsample1D(d, d, config.up_stride)
        assert config.input_size == d, "the published up_embed is Linear(input_size, output_size) on encoder outputs"
        self.up_embed = LinearEmbed(config.input_size, d)
        self.up_encoders = nn.ModuleList(
            [ConformerEncoderLayer(d, config.attention_heads, config.linear_units) for _ in range(config.num_up_blocks)]
        )
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def forward(
        self, emb: torch.Tensor, exists: torch.Tensor, chunk: int, batch: EncoderBatch | None = None
    ) -> torch.Tensor:
        """emb [N, T + 3, input_size]: T tokens then the 3 look-ahead ones, those where `exists` [N, T + 3]
        is false lying past the stream's end (zeroed after the embedding, as the published padding
        does) -> [N, 2T, D]. Offline (`batch` None) the tokens are a whole stream from position
        0; streamed, row n continues request n of `batch` (keys, values and conv inputs kept in its slot)."""
        la = self.config.pre_lookahead_len
        t = emb.shape[1] - la
        stride = self.config.up_stride
        x = self.embed(emb) * exists.unsqueeze(-1).to(emb.dtype)
        x = self._pre_lookahead(x, t, batch)
        call = AttnCall(batch and batch.tokens, ("encoders",))
        for i, layer in enumerate(self.encoders):
            x = layer(x, call, call.layer(i), chunk)
        x = self._upsample(x, batch)
        x = self.up_embed(x)
        up_call = AttnCall(batch and batch.frames, ("up_encoders",))
        for i, layer in enumerate(self.up_encoders):
            x = layer(x, up_call, up_call.layer(i), chunk * stride)
        return self.after_norm(x)

    def _pre_lookahead(self, x: torch.Tensor, t: int, batch: EncoderBatch | None) -> torch.Tensor:
        layer = self.pre_lookahead_layer
        h = F.leaky_relu(layer.conv1(x.transpose(1, 2)))  # [N, D, T]
        out = layer.conv2(_with_left(h, 2, batch, "encoder.look_left")).transpose(1, 2)
        return out + x[:, :t]

    def _upsample(self, x: torch.Tensor, batch: EncoderBatch | None) -> torch.Tensor:
        stride = self.up_layer.stride
        up = F.interpolate(x.transpose(1, 2), scale_factor=float(stride), mode="nearest")
        return self.up_layer.conv(_with_left(up, 2 * stride, batch, "encoder.up_left")).transpose(1, 2)


def _with_left(x: torch.Tensor, width: int, batch: EncoderBatch | None, name: str) -> torch.Tensor:
    """x [N, D, T] after `width` frames of left context: zeros offline, each request's kept ones streamed."""
    if batch is None:
        return F.pad(x, (width, 0))
    return batch.tokens.conv_left(name, x, width)

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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.flow.attention import AttnCall, KVBuffer, chunk_mask
from detok_stage.flow.config import EncoderConfig


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
            self._pos_cache = cache
        return cache[3][:, lo - cache[1] : hi - cache[1] + 1]

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.h, self.d_k).transpose(1, 2)  # [N, H, T, d]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
                chunk: int) -> torch.Tensor:  # fmt: skip
        """q [n, H, Tq, d] (positions qpos), k/v [n, H, Tk, d] (positions kpos) -> [n, H, Tq, d]."""
        rel = qpos.unsqueeze(1) - kpos.unsqueeze(0)  # [Tq, Tk]
        lo, hi = int(rel.min()), int(rel.max())
        p = self._projected_positions(lo, hi, q.device)
        ac = torch.matmul(q + self.pos_bias_u.unsqueeze(1), k.transpose(-2, -1))
        bd_all = torch.matmul(q + self.pos_bias_v.unsqueeze(1), p.transpose(-2, -1))  # [n, H, Tq, R]
        index = (rel - lo).expand(q.shape[0], self.h, -1, -1)
        bd = torch.gather(bd_all, -1, index)
        scores = (ac + bd) / math.sqrt(self.d_k)
        scores = scores.masked_fill(~chunk_mask(qpos, kpos, chunk), float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    def forward(self, x: torch.Tensor, call: AttnCall, buffers: list[KVBuffer] | None, chunk: int) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = self._split(self.linear_q(x)), self._split(self.linear_k(x)), self._split(self.linear_v(x))
        if not call.streamed:
            pos = torch.arange(t, device=x.device)
            out = self._attend(q, k, v, pos, pos, chunk)
        else:
            assert buffers is not None and call.starts is not None
            rows = n // len(buffers)
            parts = []
            for g, (buf, start) in enumerate(zip(buffers, call.starts, strict=True)):
                sl = slice(g * rows, (g + 1) * rows)
                keys, values = buf.append(k[sl], v[sl])
                qpos = torch.arange(start, start + t, device=x.device)
                kpos = torch.arange(start + t - keys.shape[2], start + t, device=x.device)
                parts.append(self._attend(q[sl], keys, values, qpos, kpos, chunk))
            out = torch.cat(parts)
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

    def forward(self, x: torch.Tensor, call: AttnCall, buffers: list[KVBuffer] | None, chunk: int) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), call, buffers, chunk)
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


@dataclass
class EncoderState:
    """One request's encoder cache: blocks' keys/values and the causal convs' left inputs."""

    buffers: list[KVBuffer]
    up_buffers: list[KVBuffer]
    look_left: torch.Tensor | None = None  # [1, D, 2] last conv1 outputs (pre-lookahead conv2's context)
    up_left: torch.Tensor | None = None  # [1, D, 2 * stride] last upsampled frames (up_layer conv's context)
    tokens_done: int = 0
    extra: dict = field(default_factory=dict)


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

    def new_state(self) -> EncoderState:
        return EncoderState([KVBuffer() for _ in self.encoders], [KVBuffer() for _ in self.up_encoders])

    def forward(
        self, emb: torch.Tensor, valid: list[int], chunk: int, states: list[EncoderState] | None = None
    ) -> torch.Tensor:
        """emb [N, T + 3, input_size]: T tokens then the 3 look-ahead ones, of which the first `valid[n]`
        exist (the rest lie past the stream's end and are zeroed after the embedding, as the published
        padding does) -> [N, 2T, D]. Offline (`states` None) the tokens are a whole stream from position
        0; streamed, row n continues `states[n]` (from token `states[n].tokens_done`) and updates it."""
        la = self.config.pre_lookahead_len
        t = emb.shape[1] - la
        stride = self.config.up_stride
        x = self.embed(emb)
        exists = torch.arange(t + la, device=emb.device).unsqueeze(0) < torch.tensor(valid, device=emb.device)[:, None]
        x = x * exists.unsqueeze(-1).to(x.dtype)
        x = self._pre_lookahead(x, t, states)
        call = AttnCall() if states is None else AttnCall([s.tokens_done for s in states], [s.buffers for s in states])
        for i, layer in enumerate(self.encoders):
            x = layer(x, call, call.layer(i), chunk)
        x = self._upsample(x, states)
        x = self.up_embed(x)
        up_call = (
            AttnCall()
            if states is None
            else AttnCall([s.tokens_done * stride for s in states], [s.up_buffers for s in states])
        )
        for i, layer in enumerate(self.up_encoders):
            x = layer(x, up_call, up_call.layer(i), chunk * stride)
        if states is not None:
            for s in states:
                s.tokens_done += t
        return self.after_norm(x)

    def _pre_lookahead(self, x: torch.Tensor, t: int, states: list[EncoderState] | None) -> torch.Tensor:
        layer = self.pre_lookahead_layer
        h = F.leaky_relu(layer.conv1(x.transpose(1, 2)))  # [N, D, T]
        left = self._left(states, "look_left", h, 2)
        if states is not None:
            joined = torch.cat([left, h], dim=2)
            for n, s in enumerate(states):
                s.look_left = joined[n : n + 1, :, -2:].clone()
        out = layer.conv2(torch.cat([left, h], dim=2)).transpose(1, 2)
        return out + x[:, :t]

    def _upsample(self, x: torch.Tensor, states: list[EncoderState] | None) -> torch.Tensor:
        stride = self.up_layer.stride
        up = F.interpolate(x.transpose(1, 2), scale_factor=float(stride), mode="nearest")
        left = self._left(states, "up_left", up, 2 * stride)
        joined = torch.cat([left, up], dim=2)
        if states is not None:
            for n, s in enumerate(states):
                s.up_left = joined[n : n + 1, :, -2 * stride :].clone()
        return self.up_layer.conv(joined).transpose(1, 2)

    @staticmethod
    def _left(states: list[EncoderState] | None, name: str, like: torch.Tensor, width: int) -> torch.Tensor:
        zeros = like.new_zeros(like.shape[0], like.shape[1], width)
        if states is None:
            return zeros
        for n, s in enumerate(states):
            prev = getattr(s, name)
            if prev is not None:
                zeros[n : n + 1] = prev
        return zeros

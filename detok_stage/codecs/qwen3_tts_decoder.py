"""The Qwen3-TTS-Tokenizer-12Hz decoder as causal modules that stream with carried state.

Codes -> split RVQ (1 semantic + K-1 acoustic codebooks) -> causal conv -> sliding-window
transformer -> transposed-conv upsampling with ConvNeXt blocks -> causal conv -> SnakeBeta /
transposed-conv / dilated residual blocks -> waveform in [-1, 1]. Every layer is causal: a conv
keeps the last inputs it needs as left context, a transposed conv the inputs whose kernels
overlap the next output, the transformer the keys and values inside its window. A fresh state
stands for the zero left padding of a whole-utterance forward, so decoding frames in any split
gives the samples of one forward. Modules are named as in the published `speech_tokenizer`
checkpoint (`decoder.*`). Used by `detok_stage.codecs.qwen3_tts_codec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DECODER_DEFAULTS: dict[str, Any] = {
    "codebook_size": 2048, "hidden_size": 1024, "latent_dim": 1024, "max_position_embeddings": 8000,
    "rope_theta": 10000.0, "num_attention_heads": 16, "num_key_value_heads": 16, "attention_bias": False,
    "sliding_window": 72, "intermediate_size": 3072, "layer_scale_initial_scale": 0.01, "rms_norm_eps": 1e-5,
    "num_hidden_layers": 8, "num_quantizers": 16, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
    "decoder_dim": 1536, "codebook_dim": 512,
}  # fmt: skip


def decoder_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A `decoder_config` with the reference's defaults filled in."""
    merged = {**DECODER_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    merged.setdefault("head_dim", merged["hidden_size"] // merged["num_attention_heads"])
    return merged


@dataclass
class DecoderState:
    """One stream's carried context: each causal layer's input tail, the transformer's windowed K/V."""

    tails: dict[int, torch.Tensor] = field(default_factory=dict)  # id(module) -> [B, C, context]
    keys_values: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> [B, H, P, D]
    position: int = 0  # frames through the transformer so far

    def snapshot(self) -> DecoderState:
        """A copy that later decoding leaves as it is (the layers replace tails and K/V, never write into them)."""
        return DecoderState(dict(self.tails), dict(self.keys_values), self.position)

    def with_tail(self, module: nn.Module, x: torch.Tensor, context: int) -> torch.Tensor:
        """x [B, C, T] behind the module's last `context` inputs (zeros at the start); keeps the new tail."""
        if context == 0:
            return x
        tail = self.tails.get(id(module))
        if tail is None:
            tail = x.new_zeros(x.shape[0], x.shape[1], context)
        joined = torch.cat([tail, x], dim=2)
        self.tails[id(module)] = joined[:, :, joined.shape[2] - context :]
        return joined


class CausalConvNet(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        return self.conv(state.with_tail(self, x, self.context))


class CausalTransConvNet(nn.Module):
    """A transposed conv whose output is cut to `stride` samples per input (the reference drops the right
    overhang); each input's kernel overlaps the next `context` inputs' outputs, so those inputs are kept."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.context = math.ceil((kernel_size - stride) / stride)

    def forward(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        out = self.conv(state.with_tail(self, x, self.context))
        start = self.context * self.stride
        return out[:, :, start : start + x.shape[2] * self.stride]


class SnakeBeta(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, state: DecoderState | None = None) -> torch.Tensor:
        alpha, beta = self.alpha.exp().view(1, -1, 1), self.beta.exp().view(1, -1, 1)
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConvNet(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        h = self.dwconv(x, state).transpose(1, 2)
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConvNet(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConvNet(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x), state)), state)


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        units = [ResidualUnit(out_dim, dilation) for dilation in (1, 3, 9)]
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalTransConvNet(in_dim, out_dim, 2 * rate, rate), *units])

    def forward(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, state)
        return x


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, size: int, initial: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((size,), initial))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Attention(nn.Module):
    def __init__(self, f: dict[str, Any]):
        super().__init__()
        width, heads, kv_heads, dim, bias = (
            f["hidden_size"], f["num_attention_heads"], f["num_key_value_heads"], f["head_dim"], f["attention_bias"]
        )  # fmt: skip
        self.q_proj = nn.Linear(width, heads * dim, bias=bias)
        self.k_proj = nn.Linear(width, kv_heads * dim, bias=bias)
        self.v_proj = nn.Linear(width, kv_heads * dim, bias=bias)
        self.o_proj = nn.Linear(heads * dim, width, bias=bias)
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, dim, f["sliding_window"]


class Mlp(nn.Module):
    def __init__(self, width: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, f: dict[str, Any]):
        super().__init__()
        width = f["hidden_size"]
        self.self_attn = Attention(f)
        self.mlp = Mlp(width, f["intermediate_size"])
        self.input_layernorm = RMSNorm(width, f["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(width, f["rms_norm_eps"])
        self.self_attn_layer_scale = LayerScale(width, f["layer_scale_initial_scale"])
        self.mlp_layer_scale = LayerScale(width, f["layer_scale_initial_scale"])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class DecoderTransformer(nn.Module):
    """Sliding-window causal transformer over frames, with RoPE at absolute frame positions."""

    def __init__(self, f: dict[str, Any]):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(f) for _ in range(f["num_hidden_layers"]))
        self.norm = RMSNorm(f["hidden_size"], f["rms_norm_eps"])
        self.input_proj = nn.Linear(f["latent_dim"], f["hidden_size"])
        self.output_proj = nn.Linear(f["hidden_size"], f["latent_dim"])
        self.rope_theta, self.head_dim = float(f["rope_theta"]), f["head_dim"]
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return 1.0 / (self.rope_theta**exponents)

    def reset_rope(self) -> None:
        """Recompute the RoPE frequencies (a buffer, not a weight: after building on the meta device)."""
        self.inv_freq = self._inv_freq()

    def forward(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """x [B, T, latent] -> [B, T, latent]; state carries the window of keys/values and the position."""
        seq = x.shape[1]
        positions = torch.arange(state.position, state.position + seq, device=x.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.float()[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        hidden = self.input_proj(x)
        for index, layer in enumerate(self.layers):
            attn = self._attention(index, layer.self_attn, layer.input_layernorm(hidden), cos, sin, state)
            hidden = hidden + layer.self_attn_layer_scale(attn)
            hidden = hidden + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(hidden)))
        state.position += seq
        return self.output_proj(self.norm(hidden))

    def _attention(self, index: int, attn: Attention, x, cos, sin, state: DecoderState) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = rotate(attn.q_proj(x).view(bsz, seq, attn.heads, attn.head_dim).transpose(1, 2), cos, sin)
        k = rotate(attn.k_proj(x).view(bsz, seq, attn.kv_heads, attn.head_dim).transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(bsz, seq, attn.kv_heads, attn.head_dim).transpose(1, 2)
        past = state.keys_values.get(index)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        keep_from = max(0, k.shape[2] - (attn.window - 1))  # the next query's window reaches back W - 1 keys
        state.keys_values[index] = (k[:, :, keep_from:], v[:, :, keep_from:])
        query_pos = torch.arange(k.shape[2] - seq, k.shape[2], device=x.device).unsqueeze(1)
        key_pos = torch.arange(k.shape[2], device=x.device).unsqueeze(0)
        mask = (key_pos <= query_pos) & (key_pos > query_pos - attn.window)  # [T, P + T]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=attn.head_dim**-0.5)
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class EuclideanCodebook(nn.Module):
    def __init__(self, dim: int, size: int, epsilon: float = 1e-5):
        super().__init__()
        self.epsilon = epsilon
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def embedding(self) -> torch.Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=self.epsilon)[:, None]


class VectorQuantization(nn.Module):
    def __init__(self, dim: int, size: int):
        super().__init__()
        self._codebook = EuclideanCodebook(dim, size)


class ResidualVectorQuantization(nn.Module):
    def __init__(self, count: int, dim: int, size: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(dim, size) for _ in range(count))


class ResidualVectorQuantizer(nn.Module):
    """`count` codebooks summed, then a 1x1 projection (`input_proj` is the encoder's, kept for the weights)."""

    def __init__(self, count: int, dim: int, outer: int, size: int):
        super().__init__()
        self.input_proj = nn.Conv1d(outer, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, outer, 1, bias=False)
        self.vq = ResidualVectorQuantization(count, dim, size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, n, T] -> [B, outer, T]."""
        summed = sum(F.embedding(codes[:, i], vq._codebook.embedding()) for i, vq in enumerate(self.vq.layers))
        return self.output_proj(summed.transpose(1, 2))  # type: ignore[union-attr]


class SplitResidualVectorQuantizer(nn.Module):
    def __init__(self, f: dict[str, Any]):
        super().__init__()
        outer, size = f["codebook_dim"], f["codebook_size"]
        self.rvq_first = ResidualVectorQuantizer(1, outer // 2, outer, size)
        self.rvq_rest = ResidualVectorQuantizer(f["num_quantizers"] - 1, outer // 2, outer, size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, K, T] -> latents [B, codebook_dim, T]."""
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


class Qwen3TTSDecoder(nn.Module):
    def __init__(self, f: dict[str, Any]):
        super().__init__()
        latent, width = f["latent_dim"], f["decoder_dim"]
        self.quantizer = SplitResidualVectorQuantizer(f)
        self.pre_conv = CausalConvNet(f["codebook_dim"], latent, kernel_size=3)
        self.pre_transformer = DecoderTransformer(f)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConvNet(latent, latent, factor, factor), ConvNeXtBlock(latent)])
            for factor in f["upsampling_ratios"]
        )
        rates = f["upsample_rates"]
        blocks = [DecoderBlock(width // 2**i, width // 2 ** (i + 1), rate) for i, rate in enumerate(rates)]
        out_dim = width // 2 ** len(rates)
        self.decoder = nn.ModuleList(
            [CausalConvNet(latent, width, 7), *blocks, SnakeBeta(out_dim), CausalConvNet(out_dim, 1, 7)]
        )
        self.samples_per_frame = math.prod([*rates, *f["upsampling_ratios"]])

    def forward(self, codes: torch.Tensor, state: DecoderState | None = None) -> torch.Tensor:
        """codes [B, K, T] -> audio [B, T * samples_per_frame]; `state` continues a stream (fresh: a new one)."""
        state = DecoderState() if state is None else state
        hidden = self.pre_conv(self.quantizer.decode(codes), state)
        hidden = self.pre_transformer(hidden.transpose(1, 2), state).transpose(1, 2)
        for transposed, block in self.upsample:
            hidden = block(transposed(hidden, state), state)
        for layer in self.decoder:
            hidden = layer(hidden, state)
        return hidden[:, 0].clamp(-1.0, 1.0)

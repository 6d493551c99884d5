"""Step-Audio 2's audio encoder: 16 kHz audio -> embeddings the LM reads at its audio placeholders.

A Whisper-style encoder (two GELU convs, the second with stride 2, learned positions, pre-LN
attention blocks whose key has no bias, 2x average pooling, a final LayerNorm) and an adapter
(a strided GELU conv, then Linear-ReLU-Linear to the LM's width), under the published state-dict
names (`encoder.*`, `adapter.*`). Audio is cut into pieces of at most 25 s, each its own log-mel
(128 bins, 479 zero samples appended, floored at 8 below its own max) and its own block of
placeholders. `encode_pieces` batches pieces of many requests in one forward and gives each piece
exactly what it would get alone (padding is zeroed where a lone piece sees the convs' zero
padding, and each piece's key mask follows its own length). Used by the step-audio2 adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.voice.features import whisper_log_mel

SAMPLE_RATE_HZ = 16_000
PIECE_SAMPLES = 25 * SAMPLE_RATE_HZ  # the published loop cuts audio into 25 s pieces
MEL_PADDING_SAMPLES = 479  # zero samples appended before the STFT, as published
MEL_HOP_SAMPLES = 160  # one log-mel frame per 10 ms
ADAPTER_WIDTH = 2048  # the adapter's hidden width is fixed in the published code, not in config.json
MASKED = -1.0e10  # additive bias on masked keys (the published value)


@dataclass(frozen=True)
class EncoderShape:
    """`audio_encoder_config` of the published config.json."""

    n_mels: int = 128
    n_audio_ctx: int = 1500
    n_audio_state: int = 1280
    n_audio_head: int = 20
    n_audio_layer: int = 32
    llm_dim: int = 3584
    kernel_size: int = 3
    adapter_stride: int = 2

    @classmethod
    def from_config(cls, fields: dict) -> EncoderShape:
        known = {k: int(v) for k, v in fields.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def piece_log_mel(piece: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """One piece of 16 kHz audio [N] (float in [-1, 1]) -> its log-mel [n_mels, frames]."""
    return whisper_log_mel(F.pad(piece.float(), (0, MEL_PADDING_SAMPLES)), n_mels)


def split_pieces(wave_16k: torch.Tensor) -> list[torch.Tensor]:
    """The 25 s pieces of a clip, as the published prompt builder cuts them."""
    return [wave_16k[i : i + PIECE_SAMPLES] for i in range(0, wave_16k.numel(), PIECE_SAMPLES)]


def encoder_frames(mel_frames: int) -> int:
    """Encoder outputs of a piece of `mel_frames` (its valid length is mel_frames - 2, as published)."""
    return (mel_frames - 2 + 1) // 2 // 2


def num_placeholders(mel_frames: int, shape: EncoderShape = EncoderShape()) -> int:
    """Audio placeholder positions (LM inputs) for one piece of `mel_frames` mel frames."""
    return (encoder_frames(mel_frames) + 2 - shape.kernel_size) // shape.adapter_stride + 1


def mel_frames_of(num_samples: int) -> int:
    """Log-mel frames `piece_log_mel` makes of a piece of `num_samples` 16 kHz samples."""
    return (num_samples + MEL_PADDING_SAMPLES) // MEL_HOP_SAMPLES


def clip_positions(duration_s: float, shape: EncoderShape = EncoderShape()) -> int:
    """Prompt positions a clip of `duration_s` takes: per 25 s piece its placeholders and the
    `<audio_start>` / `<audio_end>` around them (what admission charges before the replica encodes it)."""
    samples = math.ceil(duration_s * SAMPLE_RATE_HZ - 1e-6)  # (a float duration of a whole sample count)
    pieces = [min(PIECE_SAMPLES, samples - start) for start in range(0, samples, PIECE_SAMPLES)]
    return sum(num_placeholders(mel_frames_of(n), shape) + 2 for n in pieces)


class Attention(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.query, self.value, self.out = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.key = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], key_bias [B, 1, 1, T] (0 or MASKED) -> [B, T, D]."""
        batch, length, _ = x.shape
        projections = (self.query, self.key, self.value)
        heads = [p(x).view(batch, length, self.num_heads, -1).transpose(1, 2) for p in projections]
        mixed = F.scaled_dot_product_attention(*heads, attn_mask=key_bias.to(x.dtype))  # [B, h, T, d]
        return self.out(mixed.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    """Pre-LN attention + 4x GELU MLP (`mlp.0` / `mlp.2` as published)."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.attn, self.attn_ln = Attention(width, num_heads), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.mlp_ln = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_ln(x), key_bias)
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        width = shape.n_audio_state
        self.conv1 = nn.Conv1d(shape.n_mels, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = nn.Embedding(shape.n_audio_ctx, width)
        self.blocks = nn.ModuleList(Block(width, shape.n_audio_head) for _ in range(shape.n_audio_layer))
        self.after_norm = nn.LayerNorm(width)

    def forward(self, mels: torch.Tensor, mel_frames: torch.Tensor) -> torch.Tensor:
        """mels [B, n_mels, T] zero-padded, mel_frames [B] -> [B, T2 // 2, D], each row as if alone
        (rows past a piece's own pooled length are zero)."""
        frames = torch.arange(mels.shape[-1], device=mels.device)
        x = F.gelu(self.conv1(mels)) * (frames < mel_frames[:, None])[:, None]  # a lone piece's conv2 reads zeros there
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, T2, D]
        x = x + self.positional_embedding.weight[: x.shape[1]]
        key_bias = self._key_bias(mel_frames, x.shape[1])
        for block in self.blocks:
            x = block(x, key_bias)
        x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)  # [B, T2 // 2, D]
        x = self.after_norm(x)
        pooled = (mel_frames + 1) // 2 // 2
        return x * (torch.arange(x.shape[1], device=x.device) < pooled[:, None])[..., None]

    @staticmethod
    def _key_bias(mel_frames: torch.Tensor, length: int) -> torch.Tensor:
        """[B, 1, 1, T2]: key j of a piece of T mel frames is valid iff mel frame (T + 1) % 2 + 2j lies
        within its valid length T - 2 (the published mask, taken at each piece's own T)."""
        start = (mel_frames + 1) % 2
        frame = start[:, None] + 2 * torch.arange(length, device=mel_frames.device)
        valid = frame < (mel_frames - 2)[:, None]
        return torch.where(valid, 0.0, MASKED)[:, None, None, :]


class Adaptor(nn.Module):
    """Strided GELU conv, then Linear(D, 2048) - ReLU - Linear(2048, llm_dim)."""

    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        width = shape.n_audio_state
        self.conv = nn.Conv1d(width, width, shape.kernel_size, shape.adapter_stride, padding=1)
        self.linear1 = nn.Linear(width, ADAPTER_WIDTH)
        self.linear2 = nn.Linear(ADAPTER_WIDTH, shape.llm_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, D] -> [B, L', llm_dim]."""
        x = F.gelu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return self.linear2(F.relu(self.linear1(x)))


def pad_mels(mels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-mels [n_mels, T_i] -> ([B, n_mels, max T] zero-padded, [B] frame counts)."""
    longest = max(m.shape[1] for m in mels)
    batch = torch.stack([F.pad(m, (0, longest - m.shape[1])) for m in mels])
    return batch, torch.tensor([m.shape[1] for m in mels], dtype=torch.long)


@torch.inference_mode()
def encode_pieces(encoder: AudioEncoder, adaptor: Adaptor, mels: list[torch.Tensor]) -> list[torch.Tensor]:
    """One batched forward over log-mels of pieces (any requests) -> per piece [placeholders, llm_dim]."""
    param = adaptor.linear2.weight
    batch, frames = pad_mels(mels)
    hidden = adaptor(encoder(batch.to(param), frames.to(param.device)))
    shape_kernel, stride = adaptor.conv.kernel_size[0], adaptor.conv.stride[0]
    shape = EncoderShape(kernel_size=shape_kernel, adapter_stride=stride)
    return [hidden[i, : num_placeholders(int(t), shape)] for i, t in enumerate(frames)]

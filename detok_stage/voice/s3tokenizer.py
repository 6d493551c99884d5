"""The S3 speech tokenizer v2 (CosyVoice 2's `speech_tokenizer_v2.onnx`): 16 kHz speech -> 25 Hz
tokens in [0, 6561).

128-bin log mel (100 Hz) -> two stride-2 convs (25 Hz) -> pre-norm blocks whose attention adds
rotary positions (dim 64) and an FSMN memory (a depthwise conv over the values) -> finite scalar
quantisation: 8 tanh-bounded projections rounded to {0, 1, 2}, read as a base-3 number. The
parameter names follow the `s3tokenizer` package's torch layout (and chatterbox's `tokenizer.*`
keys in s3gen.safetensors), so a converted published state dict loads as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.voice.features import whisper_log_mel

ROTARY_DIM = 64  # the published rotary table is built for 64 dims whatever the head size
ROTARY_POSITIONS = 2048
FSQ_LEVELS, FSQ_DIMS = 3, 8  # 3 ** 8 = 6561 tokens
MASK_BIAS = -1.0e10


@dataclass(frozen=True)
class S3TokenizerConfig:
    n_mels: int = 128
    n_state: int = 1280
    n_head: int = 20
    n_layer: int = 6
    fsmn_kernel: int = 31

    @property
    def codebook_size(self) -> int:
        return FSQ_LEVELS**FSQ_DIMS


def tiny_s3tokenizer_config() -> S3TokenizerConfig:
    """Two narrow blocks; heads keep the published 64 dims (the rotary table's width)."""
    return S3TokenizerConfig(n_state=128, n_head=2, n_layer=2)


def rotary_cos_sin(positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[positions, 64] cos / sin: 32 frequencies (theta 10000), the table repeated twice."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, ROTARY_DIM, 2)[: ROTARY_DIM // 2].float() / ROTARY_DIM))
    angles = torch.outer(torch.arange(positions).float(), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by position (rotate-half form)."""
    left, right = x.chunk(2, dim=-1)
    return x * cos[None, :, None] + torch.cat([-right, left], dim=-1) * sin[None, :, None]


class FSMNAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int, kernel: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)
        self.fsmn_block = nn.Conv1d(n_state, n_state, kernel, groups=n_state, bias=False)
        self.pad = ((kernel - 1) // 2, kernel - 1 - (kernel - 1) // 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [B, T, C]; bias [B, 1, 1, T] (0 or -1e10 per key); keep [B, T, 1] (1 = a real frame)."""
        b, t, c = x.shape
        q = self.query(x).view(b, t, self.n_head, -1)
        k = self.key(x).view(b, t, self.n_head, -1)
        v = self.value(x).view(b, t, self.n_head, -1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        memory = v.reshape(b, t, c) * keep
        memory = (self.fsmn_block(F.pad(memory.transpose(1, 2), self.pad)).transpose(1, 2) + memory) * keep
        scale = (c // self.n_head) ** -0.25
        scores = (q.transpose(1, 2) * scale) @ (k.permute(0, 2, 3, 1) * scale) + bias
        weights = scores.float().softmax(dim=-1).to(q.dtype)
        attended = (weights @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, c)
        return self.out(attended) + memory


class Block(nn.Module):
    def __init__(self, config: S3TokenizerConfig) -> None:
        super().__init__()
        self.attn = FSMNAttention(config.n_state, config.n_head, config.fsmn_kernel)
        self.attn_ln = nn.LayerNorm(config.n_state, eps=1e-5)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_state, 4 * config.n_state), nn.GELU(), nn.Linear(4 * config.n_state, config.n_state)
        )
        self.mlp_ln = nn.LayerNorm(config.n_state, eps=1e-5)

    def forward(self, x, bias, keep, cos, sin):
        x = x + self.attn(self.attn_ln(x), bias, keep, cos, sin)
        return x + self.mlp(self.mlp_ln(x))


def _after_conv(lengths: torch.Tensor) -> torch.Tensor:
    """Frames left by a kernel-3, padding-1, stride-2 conv."""
    return (lengths - 1) // 2 + 1


class Encoder(nn.Module):
    def __init__(self, config: S3TokenizerConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(config.n_mels, config.n_state, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(config.n_state, config.n_state, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        cos, sin = rotary_cos_sin(ROTARY_POSITIONS)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, n_mels, T] (frames past `lengths` are padding) -> hidden [B, T/4, C], lengths."""
        mask = _frame_mask(lengths, mel.shape[-1])
        x = F.gelu(self.conv1(mel * mask[:, None]))
        lengths = _after_conv(lengths)
        mask = _frame_mask(lengths, x.shape[-1])
        x = F.gelu(self.conv2(x * mask[:, None]))
        lengths = _after_conv(lengths)
        mask = _frame_mask(lengths, x.shape[-1]).to(x.dtype)
        x = x.transpose(1, 2)
        bias = ((1.0 - mask) * MASK_BIAS)[:, None, None, :]
        keep = mask[:, :, None]
        t = x.shape[1]
        cos, sin = self.rotary_cos[:t].to(x), self.rotary_sin[:t].to(x)
        for block in self.blocks:
            x = block(x, bias, keep, cos, sin)
        return x, lengths


def _frame_mask(lengths: torch.Tensor, frames: int) -> torch.Tensor:
    return (torch.arange(frames, device=lengths.device)[None, :] < lengths[:, None]).float()


class FSQCodebook(nn.Module):
    def __init__(self, n_state: int) -> None:
        super().__init__()
        self.project_down = nn.Linear(n_state, FSQ_DIMS)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        levels = (self.project_down(hidden).float().tanh() * 0.9990000128746033).round() + 1
        powers = FSQ_LEVELS ** torch.arange(FSQ_DIMS, device=hidden.device, dtype=levels.dtype)
        return (levels * powers).sum(dim=-1).long()


class FSQQuantizer(nn.Module):
    def __init__(self, n_state: int) -> None:
        super().__init__()
        self._codebook = FSQCodebook(n_state)


class S3TokenizerV2(nn.Module):
    """16 kHz speech -> 25 Hz speech tokens (clips up to 30 s: the published model's window)."""

    max_mel_frames = 3000

    def __init__(self, config: S3TokenizerConfig | None = None) -> None:
        super().__init__()
        self.config = config or S3TokenizerConfig()
        self.encoder = Encoder(self.config)
        self.quantizer = FSQQuantizer(self.config.n_state)

    @torch.inference_mode()
    def quantize(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, 128, T] (T <= 3000), lengths [B] -> tokens [B, T'] (long), token lengths [B]."""
        if mel.shape[-1] > self.max_mel_frames:
            raise ValueError(f"S3 tokenizer takes at most {self.max_mel_frames} mel frames (30 s), got {mel.shape[-1]}")
        hidden, lengths = self.encoder(mel, lengths)
        return self.quantizer._codebook(hidden), lengths

    def tokenize(self, wave_16k: torch.Tensor, max_tokens: int | None = None) -> torch.Tensor:
        """One clip [N] at 16 kHz -> its tokens [N // 640 or so] (long); `max_tokens` cuts the mel to
        4 frames a token first (chatterbox's `max_len`: the cut tokens see no audio past the cut)."""
        mel = whisper_log_mel(wave_16k.float(), self.config.n_mels)
        if max_tokens is not None:
            mel = mel[:, : 4 * max_tokens]
        tokens, lengths = self.quantize(mel[None], torch.tensor([mel.shape[-1]]))
        return tokens[0, : int(lengths[0])]

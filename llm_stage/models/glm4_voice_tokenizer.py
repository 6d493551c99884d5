"""GLM-4-Voice's speech tokenizer (THUDM/glm-4-voice-tokenizer, "WhisperVQ"): 16 kHz audio -> 12.5 Hz
speech token ids in [0, 16384), the `<|audio_N|>` the GLM-4-Voice LM reads for the user's speech.

A Whisper-style encoder cut at the quantizer: per 30 s window a Whisper log-mel (128 bins), two GELU
convs (causal in the published config), the first `quantize_position` pre-LN layers under a
block-causal mask (4 s blocks), average pooling by 4, then the nearest codebook entry. Our own module
under the published names (`conv1.*`, `layers.N.*`, `codebook.weight`); `tokens` batches the windows
of many clips (16 a forward) and gives each window what it gets alone. Called by the glm4-voice family;
`glm4_voice_stream` runs the same weights block by block on microphone audio.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from core.errors import InvalidArgumentError
from detok_stage.voice.features import whisper_log_mel

SAMPLE_RATE_HZ = 16_000
WINDOW_SAMPLES = 30 * SAMPLE_RATE_HZ  # the published extractor cuts clips into 30 s windows
HOP_SAMPLES, N_FFT = 160, 400  # one log-mel frame per 10 ms
FIELD = "input_audio"
PUBLISHED_PREFIX = "model.encoder."  # keys of a whole WhisperVQForConditionalGeneration checkpoint


@dataclass(frozen=True)
class TokenizerShape:
    """The WhisperVQConfig fields the tokens depend on (config.json's names); defaults are the published ones."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    max_source_positions: int = 1500
    pooling_kernel_size: int | None = 4
    pooling_type: str = "avg"
    pooling_position: int = 16
    quantize_vocab_size: int = 16384
    quantize_position: int = 16
    quantize_causal_block_size: int | None = 200
    quantize_causal_encoder: bool = False
    encoder_causal_attention: bool = False
    encoder_causal_convolution: bool = True

    @classmethod
    def from_config(cls, config: dict) -> TokenizerShape:
        shape = cls(**{f.name: config[f.name] for f in fields(cls) if f.name in config})
        if shape.pooling_type not in ("avg", "max"):
            raise ValueError(f"config.json: pooling_type {shape.pooling_type!r} is not 'avg' or 'max'")
        if shape.pooling_kernel_size and shape.pooling_position > shape.quantize_position:
            raise ValueError("config.json: pooling_position must not lie past quantize_position")
        return shape

    @property
    def pool(self) -> int:
        return self.pooling_kernel_size or 1

    @property
    def samples_per_token(self) -> int:
        """Audio samples per token (1280 = 80 ms: hop 160 x conv stride 2 x pooling 4)."""
        return HOP_SAMPLES * 2 * self.pool


class CausalConv(nn.Conv1d):
    """A Conv1d padded only on the left (`kernel_size - 1` frames), as `encoder_causal_convolution`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class SelfAttention(nn.Module):
    """Whisper's attention: q / v / out with bias, k without."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.v_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        """x [B, T, D], allowed [B, 1, T, T] bool (or None) -> [B, T, D]."""
        return self.mix(*self.heads(x), allowed, is_causal)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q, k, v [B, h, T, d]."""
        batch, length, _ = x.shape
        projections = (self.q_proj, self.k_proj, self.v_proj)
        return tuple(p(x).view(batch, length, self.num_heads, -1).transpose(1, 2) for p in projections)

    def mix(self, q, k, v, allowed: torch.Tensor | None, is_causal: bool = False) -> torch.Tensor:
        """q [B, h, T, d] over k / v [B, h, S, d] -> [B, T, D]."""
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=is_causal)  # [B, h, T, d]
        return self.out_proj(mixed.transpose(1, 2).flatten(2))


class EncoderLayer(nn.Module):
    """Pre-LN attention, then pre-LN GELU MLP (fc1 / fc2), under the published names."""

    def __init__(self, shape: TokenizerShape, is_causal: bool) -> None:
        super().__init__()
        width = shape.d_model
        self.is_causal = is_causal
        self.self_attn = SelfAttention(width, shape.encoder_attention_heads)
        self.self_attn_layer_norm, self.final_layer_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, shape.encoder_ffn_dim), nn.Linear(shape.encoder_ffn_dim, width)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        # a causal layer ignores the padding mask, as published: padded keys lie after every valid query
        mask = None if self.is_causal else allowed
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask, self.is_causal)
        return self._mlp(x)

    def forward_cached(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None, key_valid: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [1, T, D], one block, reading the keys / values of the blocks before it (`past`, [1, h, S, d]) and
        its own; key_valid [S + T] bool or None (all valid) -> (x, the keys / values to this block's end)."""
        q, k, v = self.self_attn.heads(self.self_attn_layer_norm(x))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        x = x + self.self_attn.mix(q, k, v, None if key_valid is None else key_valid[None, None, None, :])
        return self._mlp(x), (k, v)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


def attention_allowed(valid: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """valid [B, T] bool -> [B, 1, T, T]: query i may read key j iff j is valid and (no blocks, or j <= i,
    or i and j share a block of `block_size`)."""
    length = valid.shape[1]
    keys = valid[:, None, None, :]
    if block_size is None:
        return keys.expand(-1, 1, length, -1)
    pos = torch.arange(length, device=valid.device)
    earlier_or_same_block = (pos[None, :] <= pos[:, None]) | (pos[None, :] // block_size == pos[:, None] // block_size)
    return keys & earlier_or_same_block


class SpeechTokenizer(nn.Module):
    """16 kHz clips -> GLM-4-Voice speech token ids (12.5 per second)."""

    sample_rate_hz = SAMPLE_RATE_HZ

    def __init__(self, shape: TokenizerShape = TokenizerShape()) -> None:
        super().__init__()
        self.shape = shape
        conv = CausalConv if shape.encoder_causal_convolution else nn.Conv1d
        pad = {} if shape.encoder_causal_convolution else {"padding": 1}
        self.conv1 = conv(shape.num_mel_bins, shape.d_model, kernel_size=3, **pad)
        self.conv2 = conv(shape.d_model, shape.d_model, kernel_size=3, stride=2, **pad)
        self.embed_positions = nn.Embedding(shape.max_source_positions, shape.d_model)
        is_causal = shape.encoder_causal_attention or shape.quantize_causal_encoder
        self.layers = nn.ModuleList(EncoderLayer(shape, is_causal) for _ in range(shape.quantize_position))
        self.codebook = nn.Embedding(shape.quantize_vocab_size, shape.d_model)

    @property
    def codebook_size(self) -> int:
        return self.shape.quantize_vocab_size

    @classmethod
    def preset(cls, seed: int = 0) -> SpeechTokenizer:
        """A tiny random tokenizer (the published structure at toy widths)."""
        torch.manual_seed(seed)
        return cls(tiny_shape()).eval()

    @classmethod
    def from_dir(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> SpeechTokenizer:
        """The published layout: config.json, model*.safetensors (top-level names, or `model.encoder.*`)."""
        path = Path(path)
        shape = TokenizerShape.from_config(json.loads((path / "config.json").read_text()))
        check_preprocessor(path / "preprocessor_config.json", shape)
        with torch.device("meta"):
            model = cls(shape)
        wanted = model.state_dict().keys()
        state = read_weights(sorted(path.glob("model*.safetensors")), wanted)
        missing = sorted(set(wanted) - state.keys())
        if missing:
            raise ValueError(f"{path}: the checkpoint lacks {missing[:4]}")
        model.load_state_dict(state, assign=True)
        return model.to(device=device, dtype=dtype).eval()

    def tokens(self, clips_16k: list[torch.Tensor], windows_per_forward: int = 16) -> list[torch.LongTensor]:
        """Mono float clips [N] at 16 kHz -> per clip its token ids [ceil(N_w / 1280) per 30 s window]. The
        30 s windows of all clips go through the encoder `windows_per_forward` at a time, longest first
        (each window's tokens are what it gets alone, so the grouping only bounds memory and padding)."""
        for i, clip in enumerate(clips_16k):
            check_clip(clip, f"{FIELD}[{i}]" if len(clips_16k) > 1 else FIELD)
        windows = [(i, w) for i, clip in enumerate(clips_16k) for w in split_windows(clip)]
        order = sorted(range(len(windows)), key=lambda k: -windows[k][1].numel())
        ids: list[torch.Tensor] = [torch.empty(0)] * len(windows)
        for start in range(0, len(order), windows_per_forward):
            group = order[start : start + windows_per_forward]
            for k, window_ids in zip(group, self.window_tokens([windows[k][1] for k in group]), strict=True):
                ids[k] = window_ids
        out: list[list[torch.Tensor]] = [[] for _ in clips_16k]
        for (clip_index, _), window_ids in zip(windows, ids, strict=True):
            out[clip_index].append(window_ids)
        return [torch.cat(parts) for parts in out]

    @torch.inference_mode()
    def window_tokens(self, windows: list[torch.Tensor]) -> list[torch.LongTensor]:
        """Windows of at most 30 s -> their token ids, in one forward."""
        pooled, num_tokens = self.encode(windows)
        ids = self.quantize(pooled)
        return [ids[i, :n].cpu() for i, n in enumerate(num_tokens.tolist())]

    @torch.inference_mode()
    def encode(self, windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows -> (pooled encoder outputs before the quantizer [B, T', D], tokens per window [B])."""
        param = self.conv1.weight
        mels, num_frames = window_mels(windows, self.shape)
        num_samples = torch.tensor([w.numel() for w in windows], device=param.device)
        hidden, valid = self._convs(mels.to(param), num_frames.to(param.device), num_samples)
        allowed = attention_allowed(valid, self.shape.quantize_causal_block_size)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, allowed)
            if index + 1 == self.shape.pooling_position and self.shape.pooling_kernel_size:
                hidden, valid = self._pool(hidden, valid)
                block = self.shape.quantize_causal_block_size
                allowed = attention_allowed(valid, block // self.shape.pool if block else None)
        return hidden, valid.sum(dim=1)

    def quantize(self, hidden: torch.Tensor) -> torch.LongTensor:
        """[B, T, D] -> [B, T] nearest codebook ids by squared distance (|c|^2 + |x|^2 - 2 x.c, as published)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        codes = self.codebook.weight
        distance = torch.addmm(codes.square().sum(1) + flat.square().sum(1, keepdim=True), flat, codes.T, alpha=-2.0)
        return distance.argmin(dim=1).view(hidden.shape[:2])

    def _convs(self, mels: torch.Tensor, num_frames: torch.Tensor, num_samples: torch.Tensor):
        """mels [B, n_mels, T] -> ([B, T // 2, D] with positions, [B, T // 2] valid). conv1's outputs past a
        window's own frames are zeroed, so conv2 reads what it reads alone (zero padding)."""
        frames = torch.arange(mels.shape[-1], device=mels.device)
        x = F.gelu(self.conv1(mels)) * (frames < num_frames[:, None])[:, None]
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, T2, D]
        x = x + self.embed_positions.weight[: x.shape[1]]
        # a conv frame is valid iff the mel frame it starts on holds audio (the extractor's mask, every 2nd)
        starts = 2 * HOP_SAMPLES * torch.arange(x.shape[1], device=x.device)
        return x, starts[None, :] < num_samples[:, None]

    def _pool(self, hidden: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, D] zero-padded to a multiple of the kernel, pooled -> [B, ceil(T / k), D]; valid every k-th."""
        k = self.shape.pool
        x = F.pad(hidden.transpose(1, 2), (0, -hidden.shape[1] % k))
        pool = F.avg_pool1d if self.shape.pooling_type == "avg" else F.max_pool1d
        return pool(x, k).transpose(1, 2), valid[:, ::k]


def tiny_shape() -> TokenizerShape:
    """The published structure at toy widths: 128 mel bins, causal convs, 2 layers, blocks of 8 frames."""
    return TokenizerShape(
        d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64, max_source_positions=1500,
        pooling_position=2, quantize_position=2, quantize_vocab_size=64, quantize_causal_block_size=8,
    )  # fmt: skip


def check_clip(clip: torch.Tensor, field: str) -> None:
    if not isinstance(clip, torch.Tensor) or not clip.is_floating_point():
        raise InvalidArgumentError(field, "must be a float tensor of 16 kHz samples")
    if clip.dim() != 1:
        raise InvalidArgumentError(field, f"must be mono samples [N], got shape {tuple(clip.shape)}")
    if clip.numel() == 0:
        raise InvalidArgumentError(field, "is empty")
    if not bool(torch.isfinite(clip).all()):
        raise InvalidArgumentError(field, "holds non-finite samples")


def split_windows(clip: torch.Tensor) -> list[torch.Tensor]:
    """A clip's 30 s windows, as the published extractor cuts them (the last one shorter)."""
    return list(torch.split(clip.float(), WINDOW_SAMPLES))


def window_mel(window: torch.Tensor, shape: TokenizerShape) -> torch.Tensor:
    """One window [N] -> its Whisper log-mel [n_mels, P / 160], the audio zero-padded to P, a multiple of a
    token's samples (what WhisperFeatureExtractor gives it with padding="longest", pad_to_multiple_of)."""
    padded = F.pad(window.float().cpu(), (0, -window.numel() % shape.samples_per_token))
    return whisper_log_mel(padded, shape.num_mel_bins)


def window_mels(windows: list[torch.Tensor], shape: TokenizerShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows -> ([B, n_mels, longest] zero-padded log-mels, [B] frame counts)."""
    mels = [window_mel(w, shape) for w in windows]
    longest = max(m.shape[1] for m in mels)
    batch = torch.stack([F.pad(m, (0, longest - m.shape[1])) for m in mels])
    return batch, torch.tensor([m.shape[1] for m in mels])


def num_tokens(num_samples: int, shape: TokenizerShape = TokenizerShape()) -> int:
    """Tokens of a clip of `num_samples` 16 kHz samples: ceil(window / 1280) per 30 s window."""
    whole, rest = divmod(num_samples, WINDOW_SAMPLES)
    per_window = WINDOW_SAMPLES // shape.samples_per_token
    return whole * per_window + math.ceil(rest / shape.samples_per_token)


def read_weights(files: list[Path], wanted) -> dict[str, torch.Tensor]:
    """The tensors of `wanted` from safetensors files, names with or without `model.encoder.`."""
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = key.removeprefix(PUBLISHED_PREFIX)
                if name in wanted:
                    state[name] = handle.get_tensor(key)
    return state


def check_preprocessor(path: Path, shape: TokenizerShape) -> None:
    """The published preprocessor_config.json must describe the front end we compute."""
    if not path.exists():
        return
    config = json.loads(path.read_text())
    expected = {
        "feature_size": shape.num_mel_bins,
        "sampling_rate": SAMPLE_RATE_HZ,
        "hop_length": HOP_SAMPLES,
        "n_fft": N_FFT,
    }
    for key, value in expected.items():
        if key in config and config[key] != value:
            raise ValueError(f"{path}: {key} is {config[key]}, expected {value}")

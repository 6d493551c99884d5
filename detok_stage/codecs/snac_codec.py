"""SNAC 24 kHz codec adapter for the Orpheus family (through the `snac` package).

One Orpheus frame is 7 codes over 3 levels, [L0, L1a, L2a, L2b, L1b, L2c, L2d], and decodes to
2048 samples. Real weights load from a model reference (`hubertsiuzdak/snac_24khz` in the local HF
cache, or a dir) in the published layout: config.json (constructor kwargs) + pytorch_model.bin. The
tiny preset is built from a config in code with a fixed seed and no noise blocks.

The published config sets `"noise": true`: each decoder block adds `randn * linear(x)`. Drawn per
call, that noise makes every window of a stream differ from the offline decode. Here it is drawn
from a hash of the frame's 7 codes and the sample's position inside the frame instead
(`FrameKeyedNoise`): standard-normal, fixed per frame, so a frame decodes to the same audio in any
window, in any batch, on any replica, and streamed audio equals offline audio with noise on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from snac import SNAC
from snac.layers import NoiseBlock
from torch import nn
from torch.nn.utils import parametrize

from core.checkpoints import ModelRef, load_or_preset
from core.config import ModelConfig
from detok_stage.codecs.base import CodecAdapter

TINY_SNAC = {
    "sampling_rate": 24000,
    "encoder_dim": 8,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 64,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": False,
    "depthwise": True,
}


def _strip_weight_norm(model: torch.nn.Module) -> None:
    """Fold weight-norm parametrizations into plain weights (they are recomputed every call otherwise)."""
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def frame_keys(frames: torch.Tensor) -> torch.Tensor:
    """frames [B, n, 7] codes -> [B, n] 32-bit keys, one per frame (a hash of its codes)."""
    key = torch.full(frames.shape[:2], 0x5BD1E995, dtype=torch.long, device=frames.device)
    for index in range(frames.shape[2]):
        key = _mix32(key ^ ((frames[:, :, index].long() + 1) * 0x9E3779B1 & _MASK32))
    return key


def keyed_normal(keys: torch.Tensor, per_frame: int, salt: int) -> torch.Tensor:
    """Standard-normal noise [B, n * per_frame]: sample j of frame f depends only on (keys[b, f], j, salt)."""
    offsets = torch.arange(per_frame, device=keys.device)
    base = _mix32(keys ^ salt).unsqueeze(-1)  # [B, n, 1]
    bits_a = _mix32(base ^ offsets)
    bits_b = _mix32(bits_a ^ 0x68E31DA4)
    uniform_a = ((bits_a >> 8).float() + 0.5) / 2**24  # 24-bit uniforms, exact in float32; (0, 1)
    uniform_b = (bits_b >> 8).float() / 2**24
    normal = torch.sqrt(-2 * torch.log(uniform_a)) * torch.cos(2 * torch.pi * uniform_b)  # Box-Muller
    return normal.flatten(1)


class FrameKeys:
    """The keys of the frames being decoded, set by `SnacCodec` before each forward."""

    value: torch.Tensor | None = None


class FrameKeyedNoise(nn.Module):
    """snac's NoiseBlock (x + noise * linear(x)) with noise from `keyed_normal` instead of randn."""

    def __init__(self, block: NoiseBlock, salt: int, keys: FrameKeys) -> None:
        super().__init__()
        self.linear, self.salt, self.keys = block.linear, salt, keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = self.keys.value
        if keys is None or x.shape[2] % keys.shape[1]:
            raise RuntimeError("SNAC noise needs the frame keys of this forward (decode through SnacCodec)")
        noise = keyed_normal(keys, x.shape[2] // keys.shape[1], self.salt).to(x.dtype)  # [B, T]
        return x + noise.unsqueeze(1) * self.linear(x)


def key_noise_blocks(model: SNAC) -> FrameKeys | None:
    """Swap every NoiseBlock for a FrameKeyedNoise sharing one FrameKeys; None when the model has none."""
    keys = FrameKeys()
    salt = 0
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, NoiseBlock):
                salt += 1
                setattr(parent, name, FrameKeyedNoise(child, salt * 0x1000193, keys))
    return keys if salt else None


def _load_snac_dir(codec_dir: Path) -> SNAC:
    """The published layout: config.json (constructor kwargs) + pytorch_model.bin (its state dict; old
    `weight_g` / `weight_v` weight-norm keys load through torch's compatibility hook)."""
    model = SNAC(**json.loads((codec_dir / "config.json").read_text()))
    model.load_state_dict(torch.load(codec_dir / "pytorch_model.bin", map_location="cpu", weights_only=True))
    return model


def load_snac(codec_dir: ModelRef | None, seed: int, preset: dict | None = None) -> SNAC:
    model = load_or_preset(
        codec_dir, load=_load_snac_dir, preset=lambda: SNAC(**(preset or TINY_SNAC)), seed=seed, field="model.codec_dir"
    )
    _strip_weight_norm(model)
    return model.eval()


class SnacCodec(CodecAdapter):
    codes_per_frame = 7
    samples_per_frame = 2048
    sample_rate_hz = 24000
    codebook_size = 4096

    def __init__(self, model: SNAC, device: str = "cpu") -> None:
        self.model = model.to(device)
        self.device = device
        self.noise_keys = key_noise_blocks(model)  # None for a model without noise blocks (the preset)

    @classmethod
    def build(cls, model_config: ModelConfig, device: str = "cpu", preset: dict | None = None) -> SnacCodec:
        return cls(load_snac(model_config.codec_dir, model_config.seed, preset), device)

    @staticmethod
    def frames_to_levels(frames: torch.Tensor) -> list[torch.Tensor]:
        """frames [B, n, 7] -> SNAC codes [B, n], [B, 2n], [B, 4n] (slicing only: capturable in a CUDA graph)."""
        batch = frames.shape[0]
        level0 = frames[:, :, 0]
        level1 = torch.stack([frames[:, :, i] for i in (1, 4)], dim=2).reshape(batch, -1)
        level2 = torch.stack([frames[:, :, i] for i in (2, 3, 5, 6)], dim=2).reshape(batch, -1)
        return [level0, level1, level2]

    @torch.inference_mode()
    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        return self.decode_on_device(frames.to(self.device)).float().cpu()  # [B, n * 2048]

    def decode_on_device(self, frames: torch.Tensor) -> torch.Tensor:
        if self.noise_keys is not None:
            self.noise_keys.value = frame_keys(frames)
        return self.model.decode(self.frames_to_levels(frames))[:, 0, :]

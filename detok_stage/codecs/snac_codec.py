"""SNAC 24 kHz codec adapter for the Orpheus family (through the `snac` package).

One Orpheus frame is 7 codes over 3 levels, [L0, L1a, L2a, L2b, L1b, L2c, L2d], and decodes to
2048 samples. Real weights load from a local dir (config.json + pytorch_model.bin); the tiny
preset is built from a config in code with a fixed seed and no noise blocks (deterministic).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from snac import SNAC
from torch.nn.utils import parametrize

from core.checkpoints import load_or_preset
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


def _load_snac_dir(codec_dir: Path) -> SNAC:
    """The `snac` package's published layout: config.json (constructor kwargs) + pytorch_model.bin."""
    model = SNAC(**json.loads((codec_dir / "config.json").read_text()))
    model.load_state_dict(torch.load(codec_dir / "pytorch_model.bin", map_location="cpu", weights_only=True))
    return model


def load_snac(codec_dir: Path | None, seed: int, preset: dict | None = None) -> SNAC:
    model = load_or_preset(codec_dir, load=_load_snac_dir, preset=lambda: SNAC(**(preset or TINY_SNAC)), seed=seed)
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
        return self.model.decode(self.frames_to_levels(frames))[:, 0, :]

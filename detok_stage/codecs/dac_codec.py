"""DAC detokenizer (transformers `DacModel`) for the Dia family: 44.1 kHz, hop 512, 9 codebooks.

DAC's decoder is non-causal, so it decodes stateless windows: a chunk's kept frames plus left
and right context. Its receptive field is `RECEPTIVE_FIELD_FRAMES` on each side (measured in
tests/detok_stage/test_dac.py); with that much context streamed audio equals offline decoding.
Real weights load from a local HF directory; the tiny preset is built in code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DacConfig, DacModel

from core.config import ModelConfig
from detok_stage.codecs.base import CodecAdapter

# Frames on each side that influence a frame's samples, for the (2, 4, 8, 8) upsampling stack
# (input conv, transposed convs and dilated residual units); it depends on the strides only, so
# this much context makes windows exact. Measured on the tiny preset, max |streamed - offline|
# by context frames: 0: 7e-2, 1-3: ~3e-4, >= 4: one PCM16 step (the far taps carry little weight).
RECEPTIVE_FIELD_FRAMES = 9


def tiny_dac_config(num_codebooks: int = 4, codebook_size: int = 64) -> DacConfig:
    """DAC 44.1 kHz layout (hop 512) with toy widths; matches dia-tiny's channels and codebook."""
    return DacConfig(
        encoder_hidden_size=8, downsampling_ratios=[2, 4, 8, 8], decoder_hidden_size=32, n_codebooks=num_codebooks,
        codebook_size=codebook_size, codebook_dim=8, sampling_rate=44100,
    )  # fmt: skip


def load_dac(codec_dir: Path | None, seed: int) -> DacModel:
    if codec_dir is not None:
        return DacModel.from_pretrained(str(codec_dir), local_files_only=True).eval()
    torch.manual_seed(seed)
    model = DacModel(tiny_dac_config())
    with torch.no_grad():  # random init decodes to ~1e-3 amplitude; bring it to a audible range
        model.decoder.conv2.weight.mul_(50.0)
    return model.eval()


class DacCodec(CodecAdapter):
    receptive_field_frames = RECEPTIVE_FIELD_FRAMES

    def __init__(self, model: DacModel, device: str = "cpu") -> None:
        self.model = model.to(device)
        self.device = device
        cfg = model.config
        self.codes_per_frame = cfg.n_codebooks
        self.samples_per_frame = cfg.hop_length
        self.sample_rate_hz = cfg.sampling_rate
        self.codebook_size = cfg.codebook_size

    @classmethod
    def build(cls, model_config: ModelConfig, device: str = "cpu") -> DacCodec:
        return cls(load_dac(model_config.codec_dir, model_config.seed), device)

    @torch.inference_mode()
    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [B, n, K] -> audio [B, n * hop]."""
        audio = self.model.decode(audio_codes=frames.transpose(1, 2).to(self.device)).audio_values  # [B, n * hop]
        return audio.float().cpu()

"""X-Codec detokenizer (transformers `XcodecModel`) for parallel-heads models (Bagpiper style).

A frame is one code per quantizer (8 at 4 kbps) and decodes to `hop_length` samples of 16 kHz
audio through the DAC acoustic decoder; the HuBERT semantic branch only serves encoding. Real
weights load from a local HF directory; the tiny preset (tiny DAC + tiny HuBERT) is built in code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import XcodecConfig, XcodecModel

from core.config import ModelConfig
from detok_stage.codecs.base import CodecAdapter


def tiny_xcodec_config() -> XcodecConfig:
    """8 quantizers x 1024 codes, hop 320 at 16 kHz (50 frames/s), small enough for CPU tests."""
    acoustic = {
        "model_type": "dac", "encoder_hidden_size": 8, "downsampling_ratios": [2, 4, 5, 8],
        "decoder_hidden_size": 64, "n_codebooks": 8, "codebook_size": 1024, "codebook_dim": 8,
        "hidden_size": 32, "sampling_rate": 16000,
    }  # fmt: skip
    semantic = {
        "model_type": "hubert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32, "conv_dim": (8, 8), "conv_stride": (5, 4), "conv_kernel": (10, 3),
        "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2,
    }  # fmt: skip
    return XcodecConfig(
        acoustic_model_config=acoustic, semantic_model_config=semantic, codebook_size=1024, target_bandwidths=[4.0]
    )


def load_xcodec(codec_dir: Path | None, seed: int) -> XcodecModel:
    if codec_dir is not None:
        return XcodecModel.from_pretrained(str(codec_dir), local_files_only=True).eval()
    torch.manual_seed(seed)
    return XcodecModel(tiny_xcodec_config()).eval()


class XcodecCodec(CodecAdapter):
    def __init__(self, model: XcodecModel, device: str = "cpu") -> None:
        self.model = model.to(device)
        self.device = device
        cfg = model.config
        self.codes_per_frame = cfg.num_quantizers
        self.samples_per_frame = cfg.hop_length
        self.sample_rate_hz = cfg.sample_rate
        self.codebook_size = cfg.codebook_size

    @classmethod
    def build(cls, model_config: ModelConfig, device: str = "cpu") -> XcodecCodec:
        return cls(load_xcodec(model_config.codec_dir, model_config.seed), device)

    @torch.inference_mode()
    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [B, n, Q] -> audio [B, n * hop]."""
        audio = self.model.decode(frames.transpose(1, 2).to(self.device)).audio_values  # [B, 1, n * hop]
        return audio[:, 0, :].float().cpu()

"""Stateless transformers codecs (DAC, X-Codec): `decode(audio_codes [B, K, n])` -> `audio_values`.

Both decode a window of frames in one forward with no state carried between chunks; they
differ only in their model class, their preset and where their config keeps the frame layout,
which each subclass declares.

`decode_on_device` is the one forward: `decode` runs it eagerly, and on CUDA `ChunkGraphs` captures
it per (window length, batch size). transformers' `DacModel.decode` and `XcodecModel.decode`
(embedding lookups summed over codebooks, then the convolutional decoder) read nothing back to the
host and shape nothing by tensor values, so they are captured as they are:
tests/detok_stage/test_codec_graphs.py checks the ops they run and their output.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from core.checkpoints import hf_loader, load_or_preset
from core.config import ModelConfig
from detok_stage.codecs.base import CodecAdapter


class HFCodec(CodecAdapter):
    model_cls: ClassVar[Any]

    def __init__(self, model: Any, device: str = "cpu") -> None:
        self.model = model.to(device).eval()
        self.device = device
        self.codes_per_frame, self.samples_per_frame, self.sample_rate_hz, self.codebook_size = self.layout(
            model.config
        )

    @staticmethod
    def layout(config: Any) -> tuple[int, int, int, int]:
        """(codes per frame, samples per frame, sample rate, codebook size) from the model's config."""
        raise NotImplementedError

    @classmethod
    def preset(cls) -> Any:
        """The tiny random-weight model used when no codec directory is configured."""
        raise NotImplementedError

    @classmethod
    def load(cls, model_config: ModelConfig) -> Any:
        return load_or_preset(
            model_config.codec_dir,
            load=hf_loader(cls.model_cls),
            preset=cls.preset,
            seed=model_config.seed,
            field="model.codec_dir",
        )

    @classmethod
    def build(cls, model_config: ModelConfig, device: str = "cpu") -> HFCodec:
        return cls(cls.load(model_config), device)

    @torch.inference_mode()
    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [B, n, K] -> audio [B, n * samples_per_frame] on the CPU."""
        return self.decode_on_device(frames.to(self.device)).float().cpu()

    @torch.inference_mode()
    def decode_on_device(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [B, n, K] (long, on the codec's device) -> audio [B, n * samples_per_frame] there."""
        audio = self.model.decode(audio_codes=frames.transpose(1, 2)).audio_values
        return audio.reshape(audio.shape[0], -1)  # DAC gives [B, T], X-Codec [B, 1, T]

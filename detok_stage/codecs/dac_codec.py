"""DAC detokenizer (transformers `DacModel`) for the Dia family: 44.1 kHz, hop 512, 9 codebooks.

DAC's decoder is non-causal, so it decodes stateless windows: a chunk's kept frames plus left
and right context. Its receptive field is `RECEPTIVE_FIELD_FRAMES` on each side (measured in
tests/detok_stage/test_dac.py); with that much context streamed audio equals offline decoding.
On CUDA its windows, context included, replay as CUDA graphs (`HFCodec.decode_on_device`).
"""

from __future__ import annotations

import torch
from transformers import DacConfig, DacModel

from detok_stage.codecs.hf_codec import HFCodec

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


class DacCodec(HFCodec):
    model_cls = DacModel
    receptive_field_frames = RECEPTIVE_FIELD_FRAMES

    @staticmethod
    def layout(config: DacConfig) -> tuple[int, int, int, int]:
        return config.n_codebooks, config.hop_length, config.sampling_rate, config.codebook_size

    @classmethod
    def preset(cls) -> DacModel:
        model = DacModel(tiny_dac_config())
        with torch.no_grad():  # random init decodes to ~1e-3 amplitude; bring it to an audible range
            model.decoder.conv2.weight.mul_(50.0)
        return model

"""X-Codec detokenizer (transformers `XcodecModel`) for parallel-heads models (Bagpiper style).

A frame is one code per quantizer (8 at 4 kbps) and decodes to `hop_length` samples of 16 kHz
audio through the DAC acoustic decoder; the HuBERT semantic branch only serves encoding.
"""

from __future__ import annotations

from transformers import XcodecConfig, XcodecModel

from detok_stage.codecs.hf_codec import HFCodec


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


class XcodecCodec(HFCodec):
    model_cls = XcodecModel

    @staticmethod
    def layout(config: XcodecConfig) -> tuple[int, int, int, int]:
        return config.num_quantizers, config.hop_length, config.sample_rate, config.codebook_size

    @classmethod
    def preset(cls) -> XcodecModel:
        return XcodecModel(tiny_xcodec_config())

"""A tiny random GLM-4-Voice speech tokenizer written the way THUDM/glm-4-voice-tokenizer is published:
config.json (`model_type: whisper`, `architectures: [WhisperVQEncoder]`, every WhisperConfig and WhisperVQ
field, `quantize_encoder_only: true`), one model.safetensors under the encoder's top-level names
(`conv1.*`, `embed_positions.weight`, `layers.N.*`, `codebook.weight`, `embed_positions2.weight`, and the
EMA buffers `ema_count` / `ema_weight` the published file carries) and the Whisper preprocessor_config.json.
Weights are seeded by parameter name, so the reference and ours load the same tensors from the files."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from llm_stage.models.glm4_voice_tokenizer import SpeechTokenizer, TokenizerShape, tiny_shape

REPO_ID = "THUDM/glm-4-voice-tokenizer"


def published_config(shape: TokenizerShape) -> dict:
    """config.json as published (transformers 4.44 WhisperVQConfig), at `shape`'s sizes."""
    config = {
        "_name_or_path": REPO_ID, "activation_dropout": 0.0, "activation_function": "gelu",
        "apply_spec_augment": False, "architectures": ["WhisperVQEncoder"], "attention_dropout": 0.0,
        "begin_suppress_tokens": [220, 50257], "bos_token_id": 50257, "classifier_proj_size": 256,
        "decoder_attention_heads": shape.encoder_attention_heads, "decoder_ffn_dim": shape.encoder_ffn_dim,
        "decoder_layerdrop": 0.0, "decoder_layers": 2 * shape.quantize_position, "decoder_start_token_id": 50258,
        "dropout": 0.0, "encoder_layerdrop": 0.0, "encoder_layers": 2 * shape.quantize_position,
        "eos_token_id": 50257, "init_std": 0.02, "is_encoder_decoder": True, "mask_feature_length": 10,
        "mask_feature_min_masks": 0, "mask_feature_prob": 0.0, "mask_time_length": 10, "mask_time_min_masks": 2,
        "mask_time_prob": 0.05, "max_length": 448, "max_target_positions": 448, "median_filter_width": 7,
        "model_type": "whisper", "num_hidden_layers": 2 * shape.quantize_position, "pad_token_id": 50256,
        "quantize_commit_coefficient": 0.25, "quantize_ema_decay": 0.99, "quantize_encoder_only": True,
        "quantize_loss_scale": 10.0, "quantize_restart_interval": 100, "scale_embedding": False,
        "skip_language_detection": True, "torch_dtype": "float32", "transformers_version": "4.44.1",
        "use_cache": True, "use_weighted_layer_sum": False, "vocab_size": 51866,
    }  # fmt: skip
    config.update(asdict(shape))
    return dict(sorted(config.items()))


def preprocessor_config(shape: TokenizerShape) -> dict:
    """The Whisper feature extractor's preprocessor_config.json (large-v3's, 128 bins)."""
    return {
        "chunk_length": 30, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": shape.num_mel_bins,
        "hop_length": 160, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
        "padding_value": 0.0, "processor_class": "WhisperProcessor", "return_attention_mask": False,
        "sampling_rate": 16000,
    }  # fmt: skip


def seeded_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor keyed by (seed, name): LayerNorm weights near 1, biases small, matrices ~ 1 / sqrt(fan-in)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen)
    if "layer_norm" in name:
        return (1.0 + 0.1 * noise) if name.endswith("weight") else 0.1 * noise
    if name.endswith("bias"):
        return 0.05 * noise
    if name.startswith(("codebook", "embed_positions")):
        return 0.5 * noise
    return noise / math.sqrt(math.prod(shape[1:]))


def published_state(shape: TokenizerShape, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the published file: the tokenizer's own, plus `embed_positions2` and the EMA buffers."""
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in SpeechTokenizer(shape).state_dict().items()}
    state = {name: seeded_tensor(name, size, seed) for name, size in names.items()}
    pooled_positions = math.ceil(shape.max_source_positions / shape.pool)
    state["embed_positions2.weight"] = state["embed_positions.weight"][:pooled_positions].clone()
    state["ema_count"] = torch.ones(shape.quantize_vocab_size)
    state["ema_weight"] = state["codebook.weight"].clone()
    return state


def write_glm4_voice_tokenizer(directory: Path, seed: int = 0, shape: TokenizerShape | None = None) -> Path:
    shape = shape or tiny_shape()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(published_config(shape), indent=2))
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(shape), indent=2))
    save_file(published_state(shape, seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory

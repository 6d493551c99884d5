"""CosyVoice 2 LM weights (`Qwen2LM` of the published code) under their published state-dict names,
the `cosyvoice2-tiny` random preset, and loading from a model reference. Used by the cosyvoice2
adapter (`llm_stage.models.cosyvoice2`)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from core.checkpoints import load_or_preset
from core.config import ModelConfig
from core.errors import InvalidArgumentError

SPEECH_TOKEN_SIZE = 6561  # FSQ codes of speech_tokenizer_v2, 25 per second
SPEECH_VOCAB = SPEECH_TOKEN_SIZE + 3  # rows of speech_embedding / llm_decoder: codes + 3 stop ids


class QwenBody(nn.Module):
    """Holds the Qwen2ForCausalLM as `model`, so state-dict keys read `llm.model.model.layers.N...` as published."""

    def __init__(self, qwen: Qwen2ForCausalLM) -> None:
        super().__init__()
        self.model = qwen


class CosyVoice2LM(nn.Module):
    """The LM's weights under their published names: llm_embedding, llm.model.*, llm_decoder, speech_embedding."""

    def __init__(self, qwen_config: Qwen2Config) -> None:
        super().__init__()
        hidden = qwen_config.hidden_size
        self.llm_embedding = nn.Embedding(2, hidden)
        self.llm = QwenBody(Qwen2ForCausalLM(qwen_config))
        self.llm_decoder = nn.Linear(hidden, SPEECH_VOCAB)
        self.speech_embedding = nn.Embedding(SPEECH_VOCAB, hidden)

    @property
    def qwen(self) -> Qwen2ForCausalLM:
        return self.llm.model


def tiny_qwen_config() -> Qwen2Config:
    """The cosyvoice2-tiny body: Qwen2.5's layout (q/k/v bias, tied embeddings) at toy width."""
    return Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def tiny_cosyvoice2_lm() -> CosyVoice2LM:
    """Random weights, wider than HF's init so greedy picks are not near-ties."""
    model = CosyVoice2LM(tiny_qwen_config())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model


def load_cosyvoice2_lm(config: ModelConfig) -> CosyVoice2LM:
    """The tiny preset (published checkpoints: next commit)."""
    if config.checkpoint_dir is not None:
        raise InvalidArgumentError("model.checkpoint_dir", "cosyvoice2 checkpoints are not loadable yet")
    model = load_or_preset(None, load=lambda directory: None, preset=tiny_cosyvoice2_lm, seed=config.seed)
    return model.to(config.device, getattr(torch, config.dtype)).eval()

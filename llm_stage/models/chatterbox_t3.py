"""Chatterbox T3 weights under their published state-dict names (`t3_cfg.safetensors`): a Llama body
(`tfmr`) over its own text / speech-token embeddings with learned position tables, the speaker
conditioning encoder (`cond_enc`: speaker x-vector projection, a perceiver resampler over the
voice's prompt speech tokens, the emotion-exaggeration projection) and the speech head; the
`chatterbox-tiny` random preset; loading `t3_cfg.safetensors` and the built-in voice (`conds.pt`).
Used by the chatterbox adapter (`llm_stage.models.chatterbox`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaModel

from core.errors import InvalidArgumentError


@dataclass(frozen=True)
class T3Layout:
    """T3's token layout and conditioning sizes (the published English model's, by default)."""

    text_vocab: int = 704
    speech_vocab: int = 8194
    start_text: int = 255
    stop_text: int = 0
    start_speech: int = 6561
    stop_speech: int = 6562
    max_text_tokens: int = 2048
    max_speech_tokens: int = 4096
    speaker_embed_size: int = 256
    perceiver_queries: int = 32
    perceiver_heads: int = 4


class PerceiverAttention(nn.Module):
    """One pre-norm attention block (shared LayerNorm for queries and keys/values, biased q/k/v/out
    projections), added to its queries."""

    def __init__(self, channels: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm = nn.LayerNorm(channels)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.proj_out = nn.Linear(channels, channels)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.num_heads, -1).transpose(1, 2)  # [B, heads, L, D]

    def forward(self, queries: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        q_in, kv_in = self.norm(queries), self.norm(context)
        q, k, v = self._heads(self.to_q(q_in)), self._heads(self.to_k(kv_in)), self._heads(self.to_v(kv_in))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(queries.shape)
        return queries + self.proj_out(out)


class Perceiver(nn.Module):
    """Resamples a voice's prompt speech embeddings to a fixed number of positions: learned queries
    cross-attend to the prompt, then the result attends to itself (the same block twice)."""

    def __init__(self, channels: int, num_queries: int, num_heads: int) -> None:
        super().__init__()
        self.pre_attention_query = nn.Parameter(torch.zeros(1, num_queries, channels))
        self.attn = PerceiverAttention(channels, num_heads)

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt [B, L, C] -> [B, num_queries, C]."""
        queries = self.pre_attention_query.expand(prompt.shape[0], -1, -1)
        resampled = self.attn(queries, prompt)
        return self.attn(resampled, resampled)


class CondEncoder(nn.Module):
    """Speaker x-vector projection, perceiver over prompt speech, emotion-exaggeration projection."""

    def __init__(self, layout: T3Layout, channels: int) -> None:
        super().__init__()
        self.spkr_enc = nn.Linear(layout.speaker_embed_size, channels)
        self.emotion_adv_fc = nn.Linear(1, channels, bias=False)
        self.perceiver = Perceiver(channels, layout.perceiver_queries, layout.perceiver_heads)


class LearnedPositions(nn.Module):
    """A learned table of absolute positions (`emb`, as published)."""

    def __init__(self, num_positions: int, channels: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(num_positions, channels)


class T3(nn.Module):
    """T3's weights; the Llama body's own token table (`tfmr.embed_tokens`) is never used."""

    def __init__(self, llama_config: LlamaConfig, layout: T3Layout = T3Layout()) -> None:
        super().__init__()
        channels = llama_config.hidden_size
        self.layout = layout
        self.tfmr = LlamaModel(llama_config)
        self.cond_enc = CondEncoder(layout, channels)
        self.text_emb = nn.Embedding(layout.text_vocab, channels)
        self.speech_emb = nn.Embedding(layout.speech_vocab, channels)
        self.text_pos_emb = LearnedPositions(layout.max_text_tokens + 2, channels)
        self.speech_pos_emb = LearnedPositions(layout.max_speech_tokens + 4, channels)
        self.text_head = nn.Linear(channels, layout.text_vocab, bias=False)
        self.speech_head = nn.Linear(channels, layout.speech_vocab, bias=False)

    def voice_rows(self, speaker_emb: torch.Tensor, prompt_speech: torch.Tensor) -> torch.Tensor:
        """A voice's conditioning positions before the emotion one: [1 + num_queries, C] (speaker x-vector
        [S], prompt speech tokens [L] with their speech positions 0..L-1)."""
        speaker = self.cond_enc.spkr_enc(speaker_emb.view(1, -1))  # [1, C]
        if prompt_speech.numel() == 0:
            return speaker
        positions = torch.arange(prompt_speech.numel(), device=prompt_speech.device)
        prompt = self.speech_emb(prompt_speech) + self.speech_pos_emb.emb(positions)  # [L, C]
        return torch.cat([speaker, self.cond_enc.perceiver(prompt.unsqueeze(0))[0]])


HEAD_DIM = 64


def llama_520m_config(
    hidden_size: int = 1024, intermediate_size: int = 4096, num_hidden_layers: int = 30, num_key_value_heads: int = 16
) -> LlamaConfig:
    """The published body (`Llama_520M`: llama3 rope, no biases, head_dim 64, an unused 8-row token table)."""
    return LlamaConfig(
        vocab_size=8, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=hidden_size // HEAD_DIM,
        num_key_value_heads=num_key_value_heads, head_dim=HEAD_DIM, max_position_embeddings=131072,
        tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False, rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
        },
    )  # fmt: skip


def tiny_llama_config() -> LlamaConfig:
    """chatterbox-tiny's body: Llama_520M with 2 narrow-MLP layers; the width stays 1024, which the
    published perceiver is built for."""
    return llama_520m_config(intermediate_size=1024, num_hidden_layers=2)


TINY_LAYOUT = T3Layout(max_text_tokens=256, max_speech_tokens=1024)


def tiny_t3() -> T3:
    """Random weights, wider than HF's init so greedy picks are not near-ties."""
    model = T3(tiny_llama_config(), TINY_LAYOUT)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model


@dataclass(frozen=True)
class T3Voice:
    """A voice as T3 uses it: the speaker x-vector and the clip's prompt speech tokens (`conds.pt`'s t3 part)."""

    speaker_emb: torch.Tensor  # [speaker_embed_size]
    prompt_speech: torch.Tensor  # [L] speech token ids (at most 150 in the published model)


def random_voice(layout: T3Layout, num_prompt_tokens: int = 150) -> T3Voice:
    """The preset's built-in voice (drawn from the torch RNG, as the preset's weights are)."""
    speaker = torch.randn(layout.speaker_embed_size)
    prompt = torch.randint(0, layout.start_speech, (num_prompt_tokens,))
    return T3Voice(speaker / speaker.norm(), prompt)


# ---- the published files (ResembleAI/chatterbox): t3_cfg.safetensors, conds.pt, tokenizer.json ----

T3_FILE, CONDS_FILE, TOKENIZER_FILE = "t3_cfg.safetensors", "conds.pt", "tokenizer.json"
FIELD = "model.checkpoint_dir"
ENGLISH_TEXT_VOCAB = 704  # the multilingual T3 (2454) also needs its alignment-based stop rule, not built here


def _required(path: Path) -> Path:
    if not path.is_file():
        raise InvalidArgumentError(FIELD, f"{path.parent} has no {path.name} (not a Chatterbox directory)")
    return path


def load_published_t3(directory: Path) -> T3:
    """T3 from `t3_cfg.safetensors`; the file has no config, so the body is Llama_520M's with the sizes
    its tensors have (layers, widths, table lengths)."""
    from safetensors.torch import load_file

    state = load_file(str(_required(directory / T3_FILE)))
    try:
        text_vocab = state["text_emb.weight"].shape[0]
        layers = 1 + max(int(key.split(".")[2]) for key in state if key.startswith("tfmr.layers."))
        sizes = {
            "hidden_size": state["speech_emb.weight"].shape[1], "num_hidden_layers": layers,
            "intermediate_size": state["tfmr.layers.0.mlp.gate_proj.weight"].shape[0],
            "num_key_value_heads": state["tfmr.layers.0.self_attn.k_proj.weight"].shape[0] // HEAD_DIM,
        }  # fmt: skip
        layout = T3Layout(
            text_vocab=text_vocab, speech_vocab=state["speech_emb.weight"].shape[0],
            max_text_tokens=state["text_pos_emb.emb.weight"].shape[0] - 2,
            max_speech_tokens=state["speech_pos_emb.emb.weight"].shape[0] - 4,
        )  # fmt: skip
    except (KeyError, ValueError) as err:
        raise InvalidArgumentError(FIELD, f"{directory / T3_FILE} is not a T3 state dict ({err})") from None
    if text_vocab != ENGLISH_TEXT_VOCAB:
        raise InvalidArgumentError(FIELD, f"a T3 with {text_vocab} text tokens (only the English model, 704)")
    model = T3(llama_520m_config(**sizes), layout)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise InvalidArgumentError(FIELD, f"{directory / T3_FILE} does not fit T3: {err}") from None
    return model


def load_published_voice(directory: Path) -> T3Voice:
    """The built-in voice of `conds.pt` (its `t3` part: speaker_emb [1, 256], cond_prompt_speech_tokens [1, L])."""
    conds = torch.load(_required(directory / CONDS_FILE), map_location="cpu", weights_only=True)
    t3 = conds.get("t3") if isinstance(conds, dict) else None
    if not isinstance(t3, dict) or "speaker_emb" not in t3:
        raise InvalidArgumentError(FIELD, f"{directory / CONDS_FILE} has no t3 speaker_emb")
    prompt = t3.get("cond_prompt_speech_tokens")
    prompt = torch.zeros(0, dtype=torch.long) if prompt is None else prompt.reshape(-1).long()
    return T3Voice(t3["speaker_emb"].reshape(-1).float(), prompt)

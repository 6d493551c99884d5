"""Llama backbone forward over our slot KV cache, on the weights of a transformers model.

Norms, MLPs, projections and rotary tables are transformers' own modules; attention is ours
(per-token slot/position writes, one masked SDPA per layer), so any number of requests at
different lengths run in one forward. Used by LM adapters of Llama/Qwen-architecture families.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llm_stage.kv_cache import SlotKVCache


@dataclass(frozen=True)
class BatchInputs:
    """One forward's inputs; padded rows carry the scratch slot in `write_slots`."""

    input_ids: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    slots: torch.Tensor  # [B] cache row of each request
    write_slots: torch.Tensor  # [B, T] cache row for each token (scratch for padding)
    last_index: torch.Tensor  # [B] index in T of each row's last real token


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class LlamaBackbone:
    """Runs `LlamaModel`-compatible weights (decoder layers + final norm) on a SlotKVCache."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        self.hf_model = hf_model
        self.model = hf_model.model  # LlamaModel / Qwen2Model / Qwen3Model
        self.lm_head_weight: torch.Tensor = hf_model.lm_head.weight  # [V, H]
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.scale = self.head_dim**-0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(
        self, batch: BatchInputs, cache: SlotKVCache, embeds: torch.Tensor | None = None, length: int | None = None
    ) -> torch.Tensor:
        """Returns the final-norm hidden state at each row's last real token: [B, H].

        Attention reads `length` cache positions (default: up to the batch's last position; a
        fixed length keeps shapes static and the host out of the loop, for CUDA graphs).
        """
        hidden = self.embed(batch.input_ids) if embeds is None else embeds  # [B, T, H]
        cos, sin = self.model.rotary_emb(hidden, batch.positions)  # [B, T, D]
        length = int(batch.positions.max()) + 1 if length is None else length
        key_pos = torch.arange(length, device=hidden.device)
        mask = key_pos.view(1, 1, 1, -1) <= batch.positions.unsqueeze(1).unsqueeze(-1)  # [B, 1, T, L]
        for index, layer in enumerate(self.model.layers):
            residual = hidden
            attn_in = layer.input_layernorm(hidden)
            hidden = residual + self._attention(index, layer.self_attn, attn_in, batch, cache, cos, sin, mask, length)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.model.norm(hidden[rows, batch.last_index])

    def _attention(self, index, attn, x, batch, cache, cos, sin, mask, length) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = attn.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        flat_k = k.transpose(1, 2).reshape(bsz * seq, self.num_kv_heads, self.head_dim)
        flat_v = v.transpose(1, 2).reshape(bsz * seq, self.num_kv_heads, self.head_dim)
        cache.write(index, batch.write_slots.flatten(), batch.positions.flatten(), flat_k, flat_v)
        keys, values = cache.read(index, batch.slots, length)  # [B, KV, L, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, self.num_heads * self.head_dim))

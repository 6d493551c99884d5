"""Dia encoder-decoder forward over our slot KV cache, on `DiaForConditionalGeneration` weights.

A Dia prompt is its text positions then one START position (all-BOS audio lanes). Text ids go
into a per-slot text buffer; at START the text encoder runs once for that slot and each decoder
layer's cross-attention K/V of its output is kept per slot. Decoder positions (START and every
generated step) run self-attention on the slot KV cache plus cross-attention to that slot's text.
`DiaAdapter` hands this backbone to the engine's `ModelRunner` in place of a `LlamaBackbone`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DiaForConditionalGeneration

from llm_stage.kv_cache import KVCache
from llm_stage.models.llama import BatchInputs, apply_rotary

NO_TEXT = -1  # text lane of a generated decoder position
START = -2  # text lane of the START position: run the encoder over the slot's text here


@dataclass
class CrossStore:
    """Per KV slot (+ scratch): buffered text ids, text length, cross-attention K/V per layer."""

    text_ids: torch.Tensor  # [S + 1, N] long
    text_len: torch.Tensor  # [S + 1] long
    keys: torch.Tensor  # [L, S + 1, cross_kv_heads, N, cross_head_dim]
    values: torch.Tensor


class DiaDecoderBackbone:
    """The engine-facing backbone: same attributes and `forward` contract as `LlamaBackbone`."""

    supports_decode_graphs = False  # decode graphs are wired for LlamaBackbone's fixed-length forward only
    state_is_slot_kv = False  # per-slot text and cross-attention K/V live beside the cache: moved streams re-prefill

    def __init__(self, model: DiaForConditionalGeneration) -> None:
        dec_cfg, enc_cfg = model.config.decoder_config, model.config.encoder_config
        self.hf_model = model
        self.encoder, self.decoder = model.model.encoder, model.model.decoder
        self.lm_head_weight: torch.Tensor = model.logits_dense.weight  # [C * V, H]
        self.num_layers = dec_cfg.num_hidden_layers
        self.num_heads, self.num_kv_heads = dec_cfg.num_attention_heads, dec_cfg.num_key_value_heads
        self.head_dim = dec_cfg.head_dim
        self.hidden_size = dec_cfg.hidden_size
        self.num_channels = dec_cfg.num_channels
        self.cross_heads, self.cross_kv_heads = dec_cfg.cross_num_attention_heads, dec_cfg.cross_num_key_value_heads
        self.cross_head_dim = dec_cfg.cross_head_dim
        self.max_text_tokens = enc_cfg.max_position_embeddings
        self._stores: weakref.WeakKeyDictionary[KVCache, CrossStore] = weakref.WeakKeyDictionary()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T, C + 1] -> summed channel embeddings of the audio lanes [B, T, H]."""
        return self.decoder.embeddings(ids[..., : self.num_channels])

    def store_for(self, cache: KVCache) -> CrossStore:
        """The cross-attention store that lives alongside `cache` (allocated on first use)."""
        if cache not in self._stores:
            rows, width = cache.num_rows, min(self.max_text_tokens, cache.max_seq_len)
            shape = (self.num_layers, rows, self.cross_kv_heads, width, self.cross_head_dim)
            device, dtype = cache.keys.device, cache.keys.dtype
            self._stores[cache] = CrossStore(
                torch.zeros(rows, width, dtype=torch.long, device=device),
                torch.ones(rows, dtype=torch.long, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
        return self._stores[cache]

    @torch.inference_mode()
    def forward(self, batch: BatchInputs, cache: KVCache, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm decoder hidden state at each row's last real position: [B, H]."""
        store = self.store_for(cache)
        text = batch.input_ids[..., -1]  # [B, T]
        is_text = text >= 0
        self._buffer_text(store, batch, text, is_text)
        self._encode_starts(store, batch, text == START)
        dec_pos = (batch.positions - store.text_len[batch.slots].unsqueeze(1)).clamp(0, cache.max_seq_len - 1)
        dec_pos = dec_pos.masked_fill(is_text, 0)  # [B, T] decoder position (text positions: unused)
        write_slots = batch.write_slots.masked_fill(is_text, cache.scratch_slot)
        hidden = self.embed(batch.input_ids) if embeds is None else embeds  # [B, T, H]
        cos, sin = self.decoder.rotary_emb(hidden, dec_pos)
        length = int(dec_pos.max()) + 1
        self_mask = torch.arange(length, device=hidden.device).view(1, 1, 1, -1) <= dec_pos[:, None, :, None]
        cross_len = store.text_len[batch.slots]  # [B]
        width = int(cross_len.max())
        cross_mask = (torch.arange(width, device=hidden.device) < cross_len.unsqueeze(1))[:, None, None, :]
        for index, layer in enumerate(self.decoder.layers):
            attn_in = layer.pre_sa_norm(hidden)
            step = (index, batch, cache, write_slots, dec_pos, length)
            hidden = hidden + self._self_attention(layer.self_attention, attn_in, step, cos, sin, self_mask)
            cross_in = layer.pre_ca_norm(hidden)
            hidden = hidden + self._cross_attention(index, layer.cross_attention, cross_in, store, batch, cross_mask)
            hidden = hidden + layer.mlp(layer.pre_mlp_norm(hidden))
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.decoder.norm(hidden[rows, batch.last_index])

    def _buffer_text(self, store: CrossStore, batch: BatchInputs, text: torch.Tensor, is_text: torch.Tensor) -> None:
        """Text positions write their ids at their prompt index of the row's text buffer."""
        if bool(is_text.any()):
            width = store.text_ids.shape[1]
            slots, positions = batch.write_slots[is_text], batch.positions[is_text].clamp(max=width - 1)
            store.text_ids[slots, positions] = text[is_text]

    def _encode_starts(self, store: CrossStore, batch: BatchInputs, is_start: torch.Tensor) -> None:
        """Run the text encoder for every row whose START position is in this forward."""
        rows, cols = torch.nonzero(is_start, as_tuple=True)
        if rows.numel() == 0:
            return
        slots = batch.slots[rows]
        lengths = batch.positions[rows, cols]  # START sits right after the text
        store.text_len[slots] = lengths
        width = int(lengths.max())
        mask = (torch.arange(width, device=lengths.device) < lengths.unsqueeze(1)).long()
        encoded = self.encoder(input_ids=store.text_ids[slots, :width], attention_mask=mask).last_hidden_state
        for index, layer in enumerate(self.decoder.layers):
            attn = layer.cross_attention
            k = attn.k_proj(encoded).view(len(rows), width, self.cross_kv_heads, self.cross_head_dim).transpose(1, 2)
            v = attn.v_proj(encoded).view(len(rows), width, self.cross_kv_heads, self.cross_head_dim).transpose(1, 2)
            store.keys[index, slots, :, :width] = k.to(store.keys.dtype)
            store.values[index, slots, :, :width] = v.to(store.values.dtype)

    def _self_attention(self, attn, x, step, cos, sin, mask) -> torch.Tensor:
        index, batch, cache, write_slots, dec_pos, length = step
        bsz, seq, _ = x.shape
        q = attn.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        flat_k = k.transpose(1, 2).reshape(bsz * seq, self.num_kv_heads, self.head_dim)
        cache.write(index, write_slots.flatten(), dec_pos.flatten(), flat_k, v.reshape(bsz * seq, *v.shape[2:]))
        keys, values = cache.read(index, batch.slots, length)  # [B, KV, L, D]
        # Dia folds the 1/sqrt(d) scale into its weights: attention scale is 1.
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, self.num_heads * self.head_dim))

    def _cross_attention(self, index, attn, x, store: CrossStore, batch: BatchInputs, mask) -> torch.Tensor:
        bsz, seq, _ = x.shape
        width = mask.shape[-1]
        q = attn.q_proj(x).view(bsz, seq, self.cross_heads, self.cross_head_dim).transpose(1, 2)
        keys = store.keys[index, batch.slots, :, :width]  # [B, KV, N, D]
        values = store.values[index, batch.slots, :, :width]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, self.cross_heads * self.cross_head_dim))

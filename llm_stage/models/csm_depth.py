"""CSM's depth decoder over a static KV cache, with its draws on the device (`llm_stage.inner_loop`).

The weights of transformers' `CsmDepthDecoderForCausalLM`, run one frame at a time for a batch of rows:
position 0 is the backbone's last hidden state, position p >= 1 the embedding of codebook p-1's code
(offset by (p-1) * vocab), both through `inputs_embeds_projector`; codebook head p-1 on position p's
hidden gives codebook p's logits. Positions are Python ints and the cache holds K positions, so the
loop has fixed shapes and no host sync: `CsmAdapter` captures it per batch size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import CsmDepthDecoderForCausalLM

from llm_stage.inner_loop import DeviceDrawK, InnerTable, StaticKV, table_draws
from llm_stage.models.llama import FusedLayer, apply_rotary, project, rms_norm


class DepthRunner:
    """The depth decoder's K-1 steps for a batch: `codes_on_device` -> [B, K-1] ids, nothing read back."""

    def __init__(self, depth: CsmDepthDecoderForCausalLM) -> None:
        self.depth = depth
        config = depth.config
        self.layers = [FusedLayer(layer) for layer in depth.model.layers]
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_codebooks = config.num_codebooks
        self.vocab_size = config.vocab_size
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [K, D] of positions 0..K-1 (built once per device and dtype, outside any capture)."""
        table = self._rope
        if table is None or table[0].device != like.device or table[0].dtype != like.dtype:
            positions = torch.arange(self.num_codebooks, device=like.device).unsqueeze(0)
            cos, sin = self.depth.model.rotary_emb(like, positions)
            table = self._rope = (cos[0], sin[0])
        return table

    def embed(self, codes: torch.Tensor, position: int) -> torch.Tensor:
        """codes [B] of codebook position-1 -> their input embeddings [B, backbone width]."""
        return self.depth.model.embed_tokens(codes + (position - 1) * self.vocab_size)

    def forward(self, x: torch.Tensor, start: int, kv: StaticKV) -> torch.Tensor:
        """x [B, T, backbone width] at positions start..start+T-1 -> final-norm hidden of the last one [B, H]."""
        hidden = self.depth.model.inputs_embeds_projector(x)
        cos, sin = self.rope(hidden)
        seq = hidden.shape[1]
        cos, sin = cos[start : start + seq].unsqueeze(0), sin[start : start + seq].unsqueeze(0)
        for index, fused in enumerate(self.layers):
            hidden = fused.pre_norm_block(hidden, lambda x: self._attention(index, fused, x, cos, sin, kv, start))  # noqa: B023
        return rms_norm(self.depth.model.norm, hidden[:, -1])

    def _attention(self, index: int, fused: FusedLayer, x, cos, sin, kv: StaticKV, start: int) -> torch.Tensor:
        bsz, seq, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = fused.qkv(x).view(bsz, seq, heads + 2 * kv_heads, dim).transpose(1, 2)  # [B, Hq + 2 Hkv, T, D]
        q = apply_rotary(qkv[:, :heads], cos, sin)
        k = apply_rotary(qkv[:, heads : heads + kv_heads], cos, sin)
        out = kv.attend(index, q, k, qkv[:, heads + kv_heads :], start, dim**-0.5)
        o_proj = fused.attn.o_proj
        return project(out.transpose(1, 2).reshape(bsz, seq, heads * dim), o_proj.weight, o_proj.bias)

    def logits(self, hidden: torch.Tensor, codebook: int) -> torch.Tensor:
        """hidden [B, H] at position `codebook` -> that codebook's logits [B, V] in float."""
        return F.linear(hidden, self.depth.codebooks_head.weight[codebook - 1].T).float()  # as transformers' head

    def codes_on_device(self, hidden: torch.Tensor, first: torch.Tensor, draw: DeviceDrawK) -> torch.Tensor:
        """Codebooks 1..K-1 for each row: hidden [B, H] (the backbone's), first [B] codebook-0 ids;
        `draw(logits, k)` picks on the device. Returns [B, K-1] ids."""
        rows = hidden.shape[0]
        like = self.depth.model.embed_tokens.weight
        kv = StaticKV.empty(len(self.layers), rows, self.num_kv_heads, self.num_codebooks, self.head_dim, like)
        x = torch.stack([hidden.to(like.dtype), self.embed(first, 1)], dim=1)  # [B, 2, backbone width]
        out = self.forward(x, 0, kv)
        codes: list[torch.Tensor] = []  # [K-1][B]
        for codebook in range(1, self.num_codebooks):
            codes.append(draw(self.logits(out, codebook), codebook))
            if codebook < self.num_codebooks - 1:
                out = self.forward(self.embed(codes[-1], codebook + 1).unsqueeze(1), codebook + 1, kv)
        return torch.stack(codes, dim=1)

    def static_codes(self, hidden: torch.Tensor, first: torch.Tensor, table: InnerTable) -> torch.Tensor:
        """The inner loop `llm_stage.inner_loop.InnerLoop` captures: every draw from the table."""
        return self.codes_on_device(hidden, first, table_draws(table))

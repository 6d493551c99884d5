"""KV tensors for the slot cache, allocated once at start-up.

Shape per layer: [num_slots + 1, kv_heads, max_seq_len, head_dim]; the extra last row is a
scratch slot that padded tokens write into. Used by `llm_stage.models.llama.LlamaBackbone`: decode
rows read their own tokens in place (`layer`, `llm_stage.attention`), prompt chunks gather rows
(`read`).
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_slots + 1, num_kv_heads, max_seq_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.scratch_slot = num_slots
        self.max_seq_len = max_seq_len

    @property
    def num_bytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots/positions: [N]; k/v: [N, kv_heads, head_dim]."""
        self.keys[layer, slots, :, positions] = k
        self.values[layer, slots, :, positions] = v

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values in place: [num_slots + 1, kv_heads, max_seq_len, head_dim] each."""
        return self.keys[layer], self.values[layer]

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions of each slot: [B, kv_heads, length, head_dim].

        `index_select` on the narrowed view, not `keys[layer, slots, :, :length]`: advanced indexing
        runs a per-element gather kernel, several times slower on CPU, and large enough to be a
        visible share of a small decode step."""
        keys = self.keys[layer, :, :, :length].index_select(0, slots)
        return keys, self.values[layer, :, :, :length].index_select(0, slots)

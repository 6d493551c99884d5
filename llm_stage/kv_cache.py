"""KV tensors of the LLM stage, allocated once at start-up, in one of two layouts (`CacheConfig.layout`).

`SlotKVCache`: per layer [num_slots + 1, kv_heads, max_seq_len, head_dim]; the extra last row is a
scratch slot that padded tokens write into. `PagedKVCache`: per layer a pool [num_blocks + 1,
kv_heads, block_size, head_dim] (the last block is scratch) and a block table [num_slots + 1,
max_blocks_per_slot] on the device mapping a slot's position p to (table[slot, p // block_size],
p % block_size); the scratch slot's row, and every entry a slot has not reserved, is the scratch
block. Both are addressed by (slot, position): `LlamaBackbone` writes (`write`, or the fused
rotary kernel on `layer`), decode rows read in place (`layer` + `table`, `llm_stage.attention`),
prompt chunks gather rows (`read`), KV moves copy rows (`take_row` / `put_row`).
"""

from __future__ import annotations

import torch

from core.config import CacheConfig


class SlotKVCache:
    table: torch.Tensor | None = None  # no block table: a slot is its own row
    block_size: int = 0

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
        self.num_rows = num_slots + 1
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

    def take_row(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a slot's first `length` positions on the CPU: [layers, kv_heads, length, head_dim] each."""
        return tuple(t[:, slot, :, :length].to("cpu", copy=True) for t in (self.keys, self.values))  # type: ignore[return-value]

    def put_row(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write [layers, kv_heads, n, head_dim] keys and values at a slot's positions [0, n)."""
        length = keys.shape[2]
        self.keys[:, slot, :, :length] = keys.to(self.keys.device, self.keys.dtype)
        self.values[:, slot, :, :length] = values.to(self.values.device, self.values.dtype)


def gather_pages(pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    """pool [num_blocks + 1, kv_heads, block_size, D] (one layer), table [S + 1, M], slots [B] ->
    each slot's positions [0, length): [B, kv_heads, length, D]. Reads ceil(length / block_size)
    blocks per row, whatever the table's width."""
    block_size = pool.shape[2]
    count = -(-length // block_size)
    pages = table.index_select(0, slots)[:, :count]  # [B, n]
    blocks = pool.index_select(0, pages.flatten()).view(slots.shape[0], count, *pool.shape[1:])  # [B, n, H, bs, D]
    return blocks.transpose(1, 2).reshape(slots.shape[0], pool.shape[1], count * block_size, pool.shape[3])[
        :, :, :length
    ]


class PagedKVCache:
    """Block pools + block table (see the module doc). `assign` sets a slot's row; on CUDA the
    device table is updated by the runner in the step's one host-to-device copy (`take_pending`)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_blocks: int,
        block_size: int,
    ) -> None:
        shape = (num_layers, num_blocks + 1, num_kv_heads, block_size, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.scratch_slot, self.scratch_block = num_slots, num_blocks
        self.num_rows = num_slots + 1
        self.max_seq_len, self.block_size = max_seq_len, block_size
        width = -(-max_seq_len // block_size)
        self.host_table = torch.full((num_slots + 1, width), num_blocks, dtype=torch.int32)  # [S + 1, M]
        self.table = self.host_table if self.keys.device.type == "cpu" else self.host_table.to(self.keys.device)
        self._pending: set[int] = set()

    @property
    def num_bytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2 + self.table.numel() * self.table.element_size()

    def assign(self, slot: int, blocks: list[int]) -> None:
        """A slot's blocks, position order; the rest of its row points at the scratch block."""
        row = self.host_table[slot]
        row.fill_(self.scratch_block)
        row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        if self.table is not self.host_table:
            self._pending.add(slot)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows assigned since the last call, for the device table: (slots [n], rows [n, M]) on the host."""
        if not self._pending:
            return None
        slots = torch.tensor(sorted(self._pending), dtype=torch.long)
        self._pending.clear()
        return slots, self.host_table.index_select(0, slots)

    def _cells(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each (slot, position), through the device table."""
        blocks = self.table[slots, torch.div(positions, self.block_size, rounding_mode="floor")].long()
        return blocks, positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots/positions: [N]; k/v: [N, kv_heads, head_dim]."""
        blocks, offsets = self._cells(slots, positions)
        self.keys[layer, blocks, :, offsets] = k
        self.values[layer, blocks, :, offsets] = v

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's pools in place: [num_blocks + 1, kv_heads, block_size, head_dim] each."""
        return self.keys[layer], self.values[layer]

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions of each slot: [B, kv_heads, length, head_dim]."""
        return tuple(gather_pages(t[layer], self.table, slots, length) for t in (self.keys, self.values))  # type: ignore[return-value]

    def _row_blocks(self, slot: int, length: int) -> torch.Tensor:
        blocks = self.host_table[slot, : -(-length // self.block_size)].long()
        return blocks.to(self.keys.device)

    def take_row(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a slot's first `length` positions on the CPU: [layers, kv_heads, length, head_dim] each."""
        blocks = self._row_blocks(slot, length)
        out = []
        for pool in (self.keys, self.values):
            rows = pool.index_select(1, blocks)  # [layers, n, H, bs, D]
            rows = rows.transpose(1, 2).reshape(pool.shape[0], pool.shape[2], -1, pool.shape[4])[:, :, :length]
            out.append(rows.to("cpu", copy=True))
        return out[0], out[1]

    def put_row(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write [layers, kv_heads, n, head_dim] keys and values at a slot's positions [0, n) (its
        blocks must be assigned: `assign`)."""
        length = keys.shape[2]
        blocks = self._row_blocks(slot, length)
        padded_len = blocks.numel() * self.block_size
        for pool, rows in ((self.keys, keys), (self.values, values)):
            rows = torch.nn.functional.pad(rows.to(pool.device, pool.dtype), (0, 0, 0, padded_len - length))
            layers, heads, _, dim = rows.shape
            pool[:, blocks] = rows.view(layers, heads, -1, self.block_size, dim).transpose(1, 2)


KVCache = SlotKVCache | PagedKVCache


def make_cache(
    config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """The cache `config.layout` names, for a backbone of these shapes."""
    dims = (num_layers, config.num_slots, num_kv_heads, config.max_seq_len, head_dim, dtype, device)
    if config.layout == "paged":
        return PagedKVCache(*dims, num_blocks=config.total_blocks, block_size=config.block_size)
    return SlotKVCache(*dims)

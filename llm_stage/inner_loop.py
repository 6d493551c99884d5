"""A frame's inner loop (CSM's depth decoder, Qwen3-TTS's code predictor) chained on the device.

After the backbone's step these families fill codebooks 1..K-1 with K-1 small forwards. Here the draws
between them stay on the device (`sampler.pick_on_device` on an `InnerTable`, the rows' sampling inputs
as tensors) and the KV cache is a static [B, Hkv, L, D] buffer per layer (`StaticKV`), so the loop is one
fixed-shape function of tensors: `InnerLoop` pads a batch to a captured size and replays its CUDA graph,
or runs the same function eagerly (CPU, sizes past the largest). The frame's codes are read back once
(`frame_tokens`). Used by `llm_stage.models.csm_depth` and `llm_stage.models.qwen3_tts_talker`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from core.graphs import GraphCache, graphs_available, padded_size
from core.transfer import to_device
from llm_stage.request import Request, Token
from llm_stage.sampler import SamplingRow, pick_on_device, row_keys_np

if TYPE_CHECKING:
    from llm_stage.models.base import Draws

# (logits [B, V] float of inner codebook k, k) -> [B] ids on the device
DeviceDrawK = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class CodebookTable:
    """One inner codebook's `sampler.DrawTable`: the rows' shared filters, that codebook's keys."""

    temperature: torch.Tensor  # [B, 1]
    top_k: torch.Tensor  # [B, 1], the logits' width where the row has none
    top_p: torch.Tensor  # [B, 1]
    min_p: torch.Tensor  # [B, 1]
    keys: torch.Tensor  # [B]
    greedy: torch.Tensor  # [B] bool


@dataclass(frozen=True)
class InnerTable:
    """The sampling inputs of a frame's inner draws on the device, one row per request: its parameters
    (the same for every codebook) and a key per inner codebook (seed and that draw's counter)."""

    temperature: torch.Tensor  # [B, 1] float
    top_k: torch.Tensor  # [B, 1] int64, 0 = none
    top_p: torch.Tensor  # [B, 1] float
    min_p: torch.Tensor  # [B, 1] float
    greedy: torch.Tensor  # [B] bool
    keys: torch.Tensor  # [B, K - 1] int64

    @classmethod
    def of(cls, rows: list[list[SamplingRow]], device: torch.device) -> InnerTable:
        """`rows[b][j]`: row b's draw of inner codebook j; built on the host, sent in one copy."""
        num_inner = len(rows[0])
        table = np.zeros((len(rows), 5 + num_inner))  # float64 holds 32-bit keys exactly
        for b, row_draws in enumerate(rows):
            p = row_draws[0].params
            table[b, :5] = (p.temperature, p.top_k or 0, p.top_p, p.min_p, p.is_greedy)
        flat = [row for row_draws in rows for row in row_draws]
        table[:, 5:] = row_keys_np(flat).reshape(len(rows), num_inner)
        on_device = to_device(torch.from_numpy(table), device)
        floats = on_device[:, :4].float()
        return cls(
            floats[:, 0:1], on_device[:, 1:2].long(), floats[:, 2:3], floats[:, 3:4], on_device[:, 4] > 0,
            on_device[:, 5:].long(),
        )  # fmt: skip

    @classmethod
    def padding(cls, count: int, num_inner: int, device: torch.device) -> InnerTable:
        """`count` padding rows (what `capture_all` captures on)."""
        floats, longs = torch.zeros(0, 1, device=device), torch.zeros(0, 1, dtype=torch.long, device=device)
        keys = torch.zeros(0, num_inner, dtype=torch.long, device=device)
        empty = cls(floats, longs, floats, floats, torch.zeros(0, dtype=torch.bool, device=device), keys)
        return empty.padded(count)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def codebook(self, index: int, width: int) -> CodebookTable:
        """The draw table of inner codebook `index` (0 = codebook 1) over `width` logits columns."""
        top_k = torch.where(self.top_k > 0, self.top_k, width)
        return CodebookTable(self.temperature, top_k, self.top_p, self.min_p, self.keys[:, index], self.greedy)

    def padded(self, count: int) -> InnerTable:
        """The table with padding rows up to `count`: greedy, no filters, key 0."""
        fills = (1.0, 0, 1.0, 0.0, True, 0)
        return InnerTable(*(pad_rows(t, count, fill) for t, fill in zip(self.tensors(), fills, strict=True)))


def pad_rows(tensor: torch.Tensor, count: int, fill: float | bool) -> torch.Tensor:
    """`tensor` with rows of `fill` appended up to `count` rows."""
    extra = count - tensor.shape[0]
    if extra <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_full((extra, *tensor.shape[1:]), fill)])


def table_draws(table: InnerTable) -> DeviceDrawK:
    """Draws of inner codebook k (1..K-1) from `table`, no host branch (capturable)."""
    return lambda logits, k: pick_on_device(logits, table.codebook(k - 1, logits.shape[1]))


def frame_tokens(first: torch.Tensor, rest: torch.Tensor) -> list[Token]:
    """first [B] and rest [B, K - 1] ids on the device -> one K-tuple per row: the frame's one read-back."""
    return [tuple(row) for row in torch.cat([first.unsqueeze(1), rest], dim=1).tolist()]


@dataclass(frozen=True)
class StaticKV:
    """Per layer, keys and values [B, Hkv, L, D] of positions 0..L-1 of one frame's inner loop."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def empty(cls, num_layers: int, rows: int, kv_heads: int, length: int, head_dim: int, like: torch.Tensor):
        shape = (rows, kv_heads, length, head_dim)
        make = lambda: torch.empty(shape, dtype=like.dtype, device=like.device)  # noqa: E731
        return cls([make() for _ in range(num_layers)], [make() for _ in range(num_layers)])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float):
        """Write k/v [B, Hkv, T, D] at positions start..start+T-1, then q [B, Hq, T, D] attends to
        positions 0..start+T-1 (causally among the new ones). Positions are Python ints: static shapes."""
        end = start + q.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        keys, values = self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        causal = q.shape[2] > 1 and start == 0
        return F.scaled_dot_product_attention(q, keys, values, is_causal=causal, enable_gqa=True, scale=scale)


# (hidden [B, H] of the backbone, first [B] codebook-0 ids, table) -> [B, K - 1] ids of codebooks 1..K-1
InnerFn = Callable[[torch.Tensor, torch.Tensor, InnerTable], torch.Tensor]
# the family's inner loop on the same hidden and first ids with other draws (eager) -> [B, K - 1] ids
EagerCodes = Callable[[DeviceDrawK], torch.Tensor]


class InnerLoop:
    """`fn` over batches padded to `sizes`, one CUDA graph per size (captured on its first batch, or
    before serving by `capture_all`), eager where graphs are not available (the same padded computation)
    or past the largest size (unpadded)."""

    def __init__(self, fn: InnerFn, num_codebooks: int, name: str) -> None:
        self.fn = fn
        self.num_inner = num_codebooks - 1  # codebooks 1..K-1
        self.graphs = GraphCache(self._static, name)

    def frame(
        self, draw: Draws, reqs: list[Request], hidden: torch.Tensor, first: torch.Tensor, eager: EagerCodes
    ) -> list[Token]:
        """Codebooks 1..K-1 after `first` [B] on the device, the frame read back once: this loop on the rows'
        table, or (a row's inner draws are penalised) `eager`, each draw with its penalty (`draw.on_device`)."""
        table = draw.inner_table(reqs, range(1, self.num_inner + 1), hidden.device)
        if table is None:
            rest = eager(lambda logits, k: draw.on_device(logits, None, reqs, [k] * len(reqs)))
        else:
            rest = self.run(hidden, first, table, draw.graph_sizes)
        return frame_tokens(first, rest)

    def run(self, hidden: torch.Tensor, first: torch.Tensor, table: InnerTable, sizes: Sequence[int]) -> torch.Tensor:
        """[B, K-1] ids: the graph of the size B pads to (zero hidden, greedy padding rows), else `fn` eagerly."""
        count = hidden.shape[0]
        size = padded_size(sorted(sizes), count)
        if size is None:
            return self.fn(hidden, first, table)
        inputs = [pad_rows(hidden, size, 0.0), pad_rows(first, size, 0), *table.padded(size).tensors()]
        if graphs_available(hidden.device) and self.graphs.capture(inputs):
            return self.graphs(*inputs)[:count].clone()  # (the graph's output buffer is reused by its next replay)
        return self._static(*inputs)[:count]

    def capture_all(self, sizes: Sequence[int], like_hidden: torch.Tensor) -> int:
        """Capture every size before serving, on padding rows with hidden [size, H] like `like_hidden`
        (its width, dtype and device); returns how many sizes are captured (0 off CUDA)."""
        device = like_hidden.device
        for size in sizes:
            hidden = like_hidden.new_zeros(size, like_hidden.shape[-1])
            first = torch.zeros(size, dtype=torch.long, device=device)
            self.graphs.capture([hidden, first, *InnerTable.padding(size, self.num_inner, device).tensors()])
        return self.num_captured

    @property
    def num_captured(self) -> int:
        return self.graphs.num_captured

    def _static(self, hidden: torch.Tensor, first: torch.Tensor, *table: torch.Tensor) -> torch.Tensor:
        return self.fn(hidden, first, InnerTable(*table))

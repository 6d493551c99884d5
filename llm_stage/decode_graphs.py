"""The LLM decode forward as CUDA graphs (see `core.graphs`), eager when it cannot replay.

The batch is padded to the next captured size (padding rows read and write the cache's scratch
slot) and attention spans the whole cache row, so one graph per batch size serves every
sequence length. `ModelRunner` builds it when `SchedulerConfig.cuda_graph_batch_sizes` is set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from core.graphs import GraphCache, padded_size
from llm_stage.kv_cache import SlotKVCache
from llm_stage.models.llama import BatchInputs


class DecodeGraphs:
    """The LLM decode forward ([B, 1] per row) as CUDA graphs for `batch_sizes`; larger batches run eagerly."""

    def __init__(
        self,
        forward: Callable[[BatchInputs, int], torch.Tensor],
        cache: SlotKVCache,
        batch_sizes: Sequence[int],
        input_width: int,
        pad_lanes: list[int],
    ) -> None:
        self.forward = forward  # (batch, attention length) -> hidden [B, H]
        self.cache = cache
        self.batch_sizes = sorted(set(batch_sizes))
        self.input_width = input_width
        self.pad_lanes = pad_lanes
        self.graphs = GraphCache(self._static_forward, "llm decode")

    def capture_all(self) -> int:
        """Capture every configured size on scratch-slot inputs; returns how many were captured."""
        for size in self.batch_sizes:
            self.graphs.capture(self._padding_rows(size))
        return self.graphs.num_captured

    def pad(self, batch: BatchInputs) -> list[torch.Tensor] | None:
        """The batch padded to the next captured size (scratch-slot rows), or None when it is too big."""
        num_rows = batch.input_ids.shape[0]
        size = padded_size(self.batch_sizes, num_rows)
        if size is None:
            return None
        filler = self._padding_rows(size - num_rows)
        fields = (batch.input_ids, batch.positions, batch.slots, batch.write_slots, batch.last_index)
        return [torch.cat([real, pad]) for real, pad in zip(fields, filler, strict=True)]

    def run(self, batch: BatchInputs) -> torch.Tensor | None:
        """Replay the graph for this batch's padded size; None = no graph (run eagerly)."""
        padded = self.pad(batch)
        out = self.graphs(*padded) if padded is not None else None
        return None if out is None else out[: batch.input_ids.shape[0]].clone()

    def run_static(self, batch: BatchInputs) -> torch.Tensor | None:
        """The captured computation run eagerly (what a graph replays); checks padding off-GPU."""
        padded = self.pad(batch)
        return None if padded is None else self._static_forward(*padded)[: batch.input_ids.shape[0]]

    def _padding_rows(self, count: int) -> list[torch.Tensor]:
        device, scratch = self.cache.keys.device, self.cache.scratch_slot
        return [
            torch.tensor([[self.pad_lanes]] * count, dtype=torch.long, device=device).view(count, 1, self.input_width),
            torch.zeros(count, 1, dtype=torch.long, device=device),
            torch.full((count,), scratch, dtype=torch.long, device=device),
            torch.full((count, 1), scratch, dtype=torch.long, device=device),
            torch.zeros(count, dtype=torch.long, device=device),
        ]

    def _static_forward(self, ids, positions, slots, write_slots, last_index) -> torch.Tensor:
        batch = BatchInputs(ids, positions, slots, write_slots, last_index)
        return self.forward(batch, self.cache.max_seq_len)

"""The LLM decode forward as CUDA graphs (see `core.graphs`), eager when it cannot replay.

`ModelRunner` pads a decode batch on the host to the next captured size (padding rows read and
write the cache's scratch slot at position 0) before its one copy to the device. Attention reads
each row's own tokens by the lengths in the batch (`llm_stage.attention`), so one graph per batch
size serves every sequence length at the cost of the tokens actually cached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from core.graphs import GraphCache, padded_size
from llm_stage.models.llama import BatchInputs


@dataclass(frozen=True)
class PaddingRow:
    """What a padding row holds: the pad token's lanes, position 0, the scratch slot."""

    lanes: list[int]
    scratch_slot: int


def batch_fields(batch: BatchInputs) -> list[torch.Tensor]:
    return [batch.input_ids, batch.positions, batch.slots, batch.write_slots, batch.last_index]


class DecodeGraphs:
    """The LLM decode forward ([B, 1] per row) as CUDA graphs for `batch_sizes`; larger batches run eagerly."""

    def __init__(
        self,
        forward: Callable[[BatchInputs], torch.Tensor],
        batch_sizes: Sequence[int],
        padding: PaddingRow,
        device: torch.device,
    ) -> None:
        self.forward = forward  # batch -> hidden [B, H]
        self.batch_sizes = sorted(set(batch_sizes))
        self.padding = padding
        self.device = device
        self.graphs = GraphCache(self._static_forward, "llm decode")

    def size_for(self, num_rows: int) -> int | None:
        """The captured size a batch of `num_rows` pads to; None when it is too big (eager)."""
        return padded_size(self.batch_sizes, num_rows)

    def capture_all(self) -> int:
        """Capture every configured size on scratch-slot inputs; returns how many were captured."""
        for size in self.batch_sizes:
            self.graphs.capture(self._padding_fields(size))
        return self.graphs.num_captured

    def run(self, batch: BatchInputs) -> torch.Tensor | None:
        """Replay the graph of this (padded) batch's size; None = no graph (run eagerly)."""
        out = self.graphs(*batch_fields(batch))
        return None if out is None else out.clone()

    def run_static(self, batch: BatchInputs) -> torch.Tensor:
        """The captured computation run eagerly (what a graph replays); checks padding off-GPU."""
        return self._static_forward(*batch_fields(batch))

    def _padding_fields(self, count: int) -> list[torch.Tensor]:
        scratch, width = self.padding.scratch_slot, len(self.padding.lanes)
        ids = torch.tensor([[self.padding.lanes]] * count, dtype=torch.long).view(count, 1, width)
        fields = [
            ids,
            torch.zeros(count, 1, dtype=torch.long),
            torch.full((count,), scratch, dtype=torch.long),
            torch.full((count, 1), scratch, dtype=torch.long),
            torch.zeros(count, dtype=torch.long),
        ]
        return [f.to(self.device) for f in fields]

    def _static_forward(self, ids, positions, slots, write_slots, last_index) -> torch.Tensor:
        return self.forward(BatchInputs(ids, positions, slots, write_slots, last_index))

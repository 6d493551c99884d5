"""Attention shared by the flow's encoder and estimator: chunk-causal masks over absolute positions,
and where a forward's rows sit.

Offline all rows share positions 0..T-1; streamed, each group of rows (one request) continues its own
history, kept in the pooled slots of `detok_stage.flow.slots` so a streamed chunk attends to every
earlier chunk without re-running it.
"""

from __future__ import annotations

import torch

from detok_stage.flow.slots import EstimatorHistory, SlotBatch


def chunk_mask(qpos: torch.Tensor, kpos: torch.Tensor, chunk: int, history: EstimatorHistory | None = None
               ) -> torch.Tensor:  # fmt: skip
    """[Tq, Tk] bool: key visible to query when it lies before the end of the query's chunk (all when
    chunk=0) and, with a bounded `history`, in the sink or the window before the query's chunk."""
    if chunk <= 0:
        return torch.ones(qpos.shape[0], kpos.shape[0], dtype=torch.bool, device=qpos.device)
    chunk_start = (qpos // chunk * chunk).unsqueeze(1)
    visible = kpos.unsqueeze(0) < chunk_start + chunk
    if history is not None and history.bounded:
        visible = visible & history.visible(kpos.unsqueeze(0), chunk_start)
    return visible


class AttnCall:
    """Where the rows of one forward sit: offline (positions 0..T-1, nothing kept) or streamed (`batch`:
    each request's rows continue its history in the pools; layer i's pools are named `(*prefix, i)`)."""

    def __init__(self, batch: SlotBatch | None = None, prefix: tuple = ()) -> None:
        self.batch = batch
        self.prefix = prefix

    @property
    def streamed(self) -> bool:
        return self.batch is not None

    def layer(self, index: int) -> tuple:
        return (*self.prefix, index)

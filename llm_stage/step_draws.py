"""The draws the engine hands an adapter for one step's rows (`models.base.Draws`).

Called as a `DrawFn` it is the engine's host draw (`sampler.sample`: one read-back per call). For a
frame's inner loop (CSM's depth decoder, Qwen3-TTS's code predictor) it also draws on the device and
builds the rows' `InnerTable`, keyed by the same (seed, draw counter) as the host draws, so a seeded
row draws the same codes either way. Built once by `LLMEngine`, which also captures the inner loop's
CUDA graphs at its start (`capture_inner_loop`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from core.graphs import graphs_available, padded_size
from llm_stage.inner_loop import InnerTable
from llm_stage.models.base import DrawFn, LMAdapter
from llm_stage.request import Request
from llm_stage.sampler import SamplingRow, sample_on_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepDraws:
    draw: DrawFn  # the engine's host draw
    sampling_row: Callable[[Request, int], SamplingRow]  # a request's row for a codebook's draw
    vocab_size: int  # the LM head's rows: candidate ids are below it
    chains: bool  # whether frames chain on the device (an accelerator; on CPU only when asked)
    graph_sizes: tuple[int, ...] = ()  # batch sizes the inner loops pad to and capture

    def __call__(
        self, logits: torch.Tensor, cand_ids: torch.Tensor | None, reqs: list[Request], codebooks: list[int]
    ) -> list[int]:
        return self.draw(logits, cand_ids, reqs, codebooks)

    def chains_on_device(self, reqs: list[Request]) -> bool:
        return self.chains and not any(r.sampling.is_repetition_aware for r in reqs)

    def on_device(
        self, logits: torch.Tensor, cand_ids: torch.Tensor | None, reqs: list[Request], codebooks: list[int]
    ) -> torch.Tensor:
        rows = [self.sampling_row(r, k) for r, k in zip(reqs, codebooks, strict=True)]
        return sample_on_device(logits, cand_ids, rows, self.vocab_size)

    def inner_table(self, reqs: list[Request], codebooks: range, device: torch.device) -> InnerTable | None:
        rows = [[self.sampling_row(r, k) for k in codebooks] for r in reqs]
        if any(row.params.repetition_penalty != 1.0 and len(row.history) for draws in rows for row in draws):
            return None
        return InnerTable.of(rows, device)


def inner_graph_sizes(decode_sizes: Sequence[int], max_batch_size: int) -> tuple[int, ...]:
    """The decode graph sizes a frame's inner loop pads to: up to the first that holds `max_batch_size`
    rows (it runs on the sampled rows only, never on folded prompt tokens)."""
    top = padded_size(sorted(decode_sizes), max_batch_size)
    return tuple(s for s in sorted(decode_sizes) if top is None or s <= top)


def capture_inner_loop(adapter: LMAdapter, sizes: Sequence[int]) -> int:
    """Capture `adapter`'s inner loop at `sizes` on CUDA when it has one (as the decode graphs are, at
    engine start, so no stream waits for a capture); returns the graphs captured."""
    backbone = adapter.backbone
    if adapter.inner_loop is None or not sizes or not graphs_available(backbone.lm_head_weight.device):
        return 0
    captured = adapter.inner_loop.capture_all(sizes, backbone.lm_head_weight)
    logger.info("captured %d inner-loop CUDA graphs of %s", captured, list(sizes))
    return captured

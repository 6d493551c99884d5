"""CUDA graphs for fixed-shape forwards, with an eager fallback; used by both stages.

`GraphCache` captures a tensor function once per input shape and replays it afterwards (static
input buffers are refreshed by copy). It only captures on CUDA; anywhere else, or when a
capture fails (an op that syncs with the host, for instance), it answers None and the caller
runs the function eagerly. `llm_stage.decode_graphs` and `detok_stage.graphs` build on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ShapeKey = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def graphs_available(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def default_capture_sizes(max_rows: int) -> tuple[int, ...]:
    """Batch sizes to capture when none are configured: 1, 2, 4, 8, then steps of 8 up to 32, of 16
    up to 128, of 32 up to 256 and of 64 beyond, ending at `max_rows` (a batch pads to the next
    size: at most ~1/5 of a step wasted on padding rows past 8, with few graphs to capture)."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size += size if size < 8 else 8 if size < 32 else 16 if size < 128 else 32 if size < 256 else 64
    return (*sizes, max_rows)


def padded_size(sizes: Sequence[int], count: int) -> int | None:
    """The smallest captured size (`sizes` ascending) that holds `count` rows; None = too many."""
    return next((s for s in sizes if s >= count), None)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    output: torch.Tensor


class GraphCache:
    """`fn(*tensors) -> tensor` captured per input shape; `__call__` returns None when it cannot replay."""

    def __init__(self, fn: Callable[..., torch.Tensor], name: str, warmup_runs: int = 2) -> None:
        self.fn = fn
        self.name = name
        self.warmup_runs = warmup_runs
        self._captured: dict[ShapeKey, _Captured] = {}
        self._failed: set[ShapeKey] = set()
        self._pool = None

    @staticmethod
    def key(inputs: Sequence[torch.Tensor]) -> ShapeKey:
        return tuple((tuple(t.shape), t.dtype) for t in inputs)

    @property
    def num_captured(self) -> int:
        return len(self._captured)

    def has(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether a graph for these inputs' shapes is captured."""
        return self.key(inputs) in self._captured

    def capture(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Capture for these inputs' shapes (their values are only used to warm up); True on success."""
        key = self.key(inputs)
        if key in self._captured:
            return True
        if key in self._failed or not all(graphs_available(t.device) for t in inputs):
            return False
        try:
            self._captured[key] = self._record(inputs)
            return True
        except Exception as err:  # any op that cannot be captured: run this shape eagerly from now on
            logger.warning("%s: CUDA graph capture failed for %s (%s); running it eagerly", self.name, key, err)
            self._failed.add(key)
            return False

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor | None:
        entry = self._captured.get(self.key(inputs))
        if entry is None:
            return None
        for static, value in zip(entry.inputs, inputs, strict=True):
            static.copy_(value, non_blocking=True)
        entry.graph.replay()
        return entry.output

    def _record(self, inputs: Sequence[torch.Tensor]) -> _Captured:
        static = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(self.warmup_runs):  # lazy inits and allocator warm-up outside the graph
                self.fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
            output = self.fn(*static)
        self._pool = graph.pool()
        return _Captured(graph, static, output)

"""The codec forward over full-length chunk windows as CUDA graphs (see `core.graphs`).

One graph per (window length, chunk-batch size), every length up to the full `left + chunk +
right` window: steady-state chunks, and the first chunks, adaptive chunks and stream ends whose
windows are shorter (on an H200 an eager SNAC decode of one short window took 11-15 ms, mostly
launches, against 1.6-1.8 ms replayed). A smaller group is padded with copies of its first row
(codec rows are independent). What is captured is the codec's `decode_on_device`, offered by the
stateless codecs: SNAC, DAC and X-Codec (`codecs/hf_codec.py`); a DAC window carries its receptive
field as context frames, so each window length's graph decodes it as the eager forward does.
Stateful codecs (Mimi, Qwen3-TTS, S3Gen, GLM-4-Voice) decode eagerly (`CodecAdapter.captures_windows`).
Built by `DetokEngine`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from core.config import DetokConfig
from core.graphs import GraphCache, default_capture_sizes, graphs_available, padded_size
from detok_stage.codecs.base import CodecAdapter

logger = logging.getLogger(__name__)


class ChunkGraphs:
    def __init__(self, codec: CodecAdapter, window_frames: int, batch_sizes: Sequence[int], device: str) -> None:
        self.codec = codec
        self.window_frames = window_frames
        self.batch_sizes = sorted(set(batch_sizes))
        self.device = device
        self.graphs = GraphCache(codec.decode_on_device, "detok decode")

    @classmethod
    def build(cls, codec: CodecAdapter, config: DetokConfig) -> ChunkGraphs | None:
        """None (eager decoding) unless graphs can run here: on CUDA by default (sizes derived from
        `max_batch_chunks` when none are configured); configured sizes that cannot run say so."""
        explicit = bool(config.cuda_graph_batch_sizes)
        if not config.cuda_graphs or not (explicit or graphs_available(config.device)):
            return None
        if not graphs_available(config.device):
            logger.warning("CUDA graphs requested on %s: the detokenizer decodes eagerly", config.device)
            return None
        sizes = config.cuda_graph_batch_sizes or default_capture_sizes(config.max_batch_chunks)
        if codec.is_stateful and codec.enable_graphs(sizes):
            logger.info("the codec replays its streamed forward as CUDA graphs for chunk batches of %s", sizes)
            return None
        if not codec.captures_windows or config.schedule == "reference":
            log = logger.warning if explicit else logger.info
            log("CUDA graphs need a stateless codec with a device decode and the wide schedule: decoding eagerly")
            return None
        window = config.left_context_frames + config.chunk_frames + config.right_context_frames
        graphs = cls(codec, window, sizes, config.device)
        captured = graphs.capture_all()
        logger.info("captured %d detokenizer CUDA graphs: windows of 1-%d frames x %s", captured, window, sizes)
        return graphs

    def capture_all(self) -> int:
        for length in range(1, self.window_frames + 1):
            for size in self.batch_sizes:
                self.graphs.capture([self._zeros(size, length)])
        return self.graphs.num_captured

    def pad(self, frames: torch.Tensor) -> torch.Tensor | None:
        """[G, n, K] -> [size, n, K] on the codec's device for the next captured size; None = eager
        (more chunks than the largest size, or a window longer than the schedule's)."""
        count, length, _ = frames.shape
        size = padded_size(self.batch_sizes, count)
        if length > self.window_frames or size is None:
            return None
        return torch.cat([frames, frames[:1].expand(size - count, -1, -1)]).to(self.device)

    def run(self, frames: torch.Tensor) -> torch.Tensor | None:
        """Audio [G, n * samples_per_frame] on the CPU from the graph, or None (decode eagerly)."""
        padded = self.pad(frames)
        out = self.graphs(padded) if padded is not None else None
        return None if out is None else out[: frames.shape[0]].float().cpu()

    def _zeros(self, size: int, length: int) -> torch.Tensor:
        return torch.zeros(size, length, self.codec.codes_per_frame, dtype=torch.long, device=self.device)

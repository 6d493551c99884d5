"""Test helper: requests' frames interleaved frame by frame, as an LLM stage emits them, through
one DetokEngine (many windows per forward); returns each request's audio as floats."""

from __future__ import annotations

import torch

from core.config import DetokConfig
from detok_stage.codecs.base import CodecAdapter
from detok_stage.engine import DetokEngine, pcm16_to_float
from detok_stage.graphs import ChunkGraphs
from llm_stage.chunking import Chunker, ChunkSchedule


def stream_interleaved(
    codec: CodecAdapter, frames_by_req: dict[str, torch.Tensor], config: DetokConfig,
    graphs: ChunkGraphs | None = None, frames_per_push: int = 1,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """`frames_per_push` frames of each request in turn, then an engine step; `graphs`: the engine's window
    graphs (None: it decodes eagerly)."""
    engine = DetokEngine(codec, config)
    engine.graphs = graphs
    chunkers = {rid: Chunker(rid, ChunkSchedule.from_config(config)) for rid in frames_by_req}
    pcm: dict[str, list[bytes]] = {rid: [] for rid in frames_by_req}
    for t in range(0, max(len(f) for f in frames_by_req.values()), frames_per_push):
        for rid, frames in frames_by_req.items():
            if t < len(frames):
                chunks = chunkers[rid].push(frames[t : t + frames_per_push].tolist())
                chunks += chunkers[rid].finish() if t + frames_per_push >= len(frames) else []
                for chunk in chunks:
                    engine.submit(chunk)
        for out in engine.step():
            pcm[out.req_id].append(out.pcm16)
    while engine.has_work:
        for out in engine.step():
            pcm[out.req_id].append(out.pcm16)
    return {rid: torch.from_numpy(pcm16_to_float(b"".join(parts))) for rid, parts in pcm.items()}


def cut_with_resume(frames: torch.Tensor, right_context: int) -> tuple[list, list]:
    """A stream's chunks as first cut, and the chunks from seq 2 on as an LLM replica that resumed it
    cuts them again (another schedule: the first of them starts where chunk 2 did, but ends elsewhere),
    as when the replica that cut chunks 2 and 3 died before the router got their audio."""
    chunker = Chunker("r", ChunkSchedule(2, 4, 3, right_context))
    first = chunker.push(frames.tolist()) + chunker.finish()
    shipped = first[1].keep_end
    again = Chunker.resumed("r", ChunkSchedule(3, 5, 3, right_context), 2, shipped)
    again.add_frames(frames[:shipped].tolist())
    resent = again.push(frames[shipped:].tolist()) + again.finish()
    assert resent[0].keep_start == first[2].keep_start and resent[0].keep_end != first[2].keep_end
    return first, resent

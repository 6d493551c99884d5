"""Start-up warm-up of a detokenizer engine at its largest batch, before the first real chunk.

For the reason the LLM engine warms up (`llm_stage.warm_up`: allocators keep the high water of the
first batch bigger than any before; a detok replica's RSS rose by 5% in one step 27 minutes into
the 2026-12-05 soak). The engine decodes `max_batch_chunks` chunks of the longest window the
schedule cuts (its left context, capped for whole-stream schedules, its largest chunk and its
right context) in one step, then forgets them; its counters are as before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from core.messages import TokenChunk
from detok_stage.engine import DetokEngine

logger = logging.getLogger(__name__)

MAX_STEPS = 64  # a stateful codec decodes its chunks over several steps at most this many


@dataclass(frozen=True)
class DetokWarmUp:
    """What a detokenizer warm-up ran (logged at start)."""

    chunks: int
    window_frames: int
    steps: int
    seconds: float


def warm_up_chunks(window: tuple[int, int, int], count: int, codes_per_frame: int) -> list[TokenChunk]:
    """`count` final chunks, one per warm-up request, each a `window` (left context, kept frames,
    right context) of code 0."""
    left, keep, right = window
    frames = [[0] * codes_per_frame for _ in range(left + keep + right)]
    return [TokenChunk(f"warm-up-{i}", 0, frames, 0, left, left + keep, True) for i in range(count)]


def warm_up(engine: DetokEngine, window: tuple[int, int, int]) -> DetokWarmUp:
    """Decode one batch of the longest `window` the LLM side cuts (`ChunkSchedule.longest_window`:
    left context, kept frames, right context); the engine is left idle."""
    assert not engine.num_queued, "warm up a detokenizer before it serves"
    started_s = time.perf_counter()
    decoded_frames = engine.num_decoded_frames
    chunks = warm_up_chunks(window, engine.config.max_batch_chunks, engine.codec.codes_per_frame)
    steps = 0
    try:
        for chunk in chunks:
            engine.submit(chunk)
        while engine.has_work and steps < MAX_STEPS:
            engine.step()
            steps += 1
    finally:
        for chunk in chunks:
            engine.release(chunk.req_id)
        engine.num_decoded_frames = decoded_frames
    report = DetokWarmUp(len(chunks), chunks[0].num_frames, steps, time.perf_counter() - started_s)
    logger.info("detokenizer warm-up: %s", report)
    return report

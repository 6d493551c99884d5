"""Milliseconds per LLM-engine decode step on the CPU preset, as streams see it in serving.

Model: the `orpheus-tiny` backbone with the Orpheus frame-slot head. Each row samples with
Orpheus' default rules (T 0.6, top-p 0.8, repetition penalty 1.3). Requests are added one
step apart, as Poisson arrivals come. Two rows per batch size, alternated: `staggered`
(`align_starts` off: each request starts at once, so rows sit on different frame slots and
each slot head is a separate matmul) and `aligned` (the default: a start waits for the phase
most rows are in, so the rows share one slot head).
Per stream, real time needs 7 tokens (one 85.3 ms SNAC frame) per 85.3 ms, so a step under
12.2 ms keeps every row of the batch ahead of playback; the x-real-time column says by how much.
Run: `.venv/bin/python -m loadtest.step_bench --rows 1 4 8`
"""

from __future__ import annotations

import argparse
import time

import torch

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from detok_stage.codecs.snac_codec import SnacCodec
from llm_stage.engine import LLMEngine
from llm_stage.models.orpheus import TOKENS_PER_FRAME, OrpheusAdapter
from loadtest.decode_bench import prompts

FRAME_S = SnacCodec.samples_per_frame / SnacCodec.sample_rate_hz  # 85.3 ms of audio per frame


def ms_per_step(adapter: OrpheusAdapter, rows: int, max_tokens: int, **scheduler) -> float:
    """Mean step from when every request has been added (one per step) until all finish.
    `scheduler`: more SchedulerConfig fields (CUDA graphs, async steps)."""
    engine = LLMEngine(
        adapter, CacheConfig(num_slots=rows, max_seq_len=max_tokens + 64),
        SchedulerConfig(max_batch_size=rows, prefill_token_budget=4096, **scheduler),
    )  # fmt: skip
    params = adapter.default_sampling.model_copy(update={"max_tokens": max_tokens})
    for i, prompt in enumerate(prompts(adapter, rows, 16)):
        engine.add_prompt(f"r{i}", prompt, params)
        engine.step()
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    engine.close()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    adapter = OrpheusAdapter.build(ModelConfig(torch_threads=1))
    for rows in args.rows:
        for name, align in (("staggered", False), ("aligned", True)):
            step_ms = ms_per_step(adapter, rows, args.max_tokens, align_starts=align)
            x_real_time = FRAME_S * 1e3 / (TOKENS_PER_FRAME * step_ms)
            speed = f"{step_ms:.2f} ms per step, {x_real_time:.2f}x real time per stream"
            print(f"{rows} rows {name:9s}: {speed}", flush=True)


if __name__ == "__main__":
    main()

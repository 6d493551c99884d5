"""Cost of one `llm_stage.sampler.sample` call on Orpheus-shaped rows (4,097 candidate columns).

Two logit shapes: `peaked` (what a trained model gives: the nucleus sits in a few dozen
columns) and `flat` (the random-weight CPU preset: top-p 0.8 keeps thousands of columns).
Orpheus' default sampling (T 0.6, top-p 0.8, repetition penalty 1.3 over the whole sequence:
a 20-token prompt + 300 generated tokens), a seed per row (counter-based draws, `llm_stage.draws`).
Each shape is timed on both paths: `host` (what `sample` does with CPU logits: numpy) and
`torch` (`sample_on_device`, the accelerator path, here on CPU tensors).
Run: `.venv/bin/python -m loadtest.sampler_bench --rows 1 4 8`
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from llm_stage.models.orpheus import (
    AUDIO_TOKEN_BASE,
    CODES_PER_SLOT,
    TOKENS_PER_FRAME,
    OrpheusAdapter,
    candidate_table,
)
from llm_stage.sampler import SamplingRow, sample, sample_on_device

SCALES = {"peaked": 3.0, "flat": 0.05}  # std of the random logits
SAMPLERS = {"host": sample, "torch": sample_on_device}  # what CPU logits get, and the torch path on them


def rows_for(num_rows: int, rng: random.Random) -> list[SamplingRow]:
    params = OrpheusAdapter.default_sampling
    rows = []
    for b in range(num_rows):
        prompt = [rng.randrange(128_000) for _ in range(20)]
        generated = [AUDIO_TOKEN_BASE + rng.randrange(TOKENS_PER_FRAME * CODES_PER_SLOT) for _ in range(300)]
        rows.append(SamplingRow(params, prompt + generated, seed=b, counter=320))
    return rows


def ms_per_call(num_rows: int, scale: float, calls: int, sampler=sample) -> float:
    rng = random.Random(0)
    cand = candidate_table()[[b % TOKENS_PER_FRAME for b in range(num_rows)]]
    logits = torch.randn(num_rows, CODES_PER_SLOT + 1, generator=torch.Generator().manual_seed(0)) * scale
    rows = rows_for(num_rows, rng)
    for _ in range(10):
        sampler(logits, cand, rows)
    start = time.perf_counter()
    for _ in range(calls):
        sampler(logits, cand, rows)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for shape, scale in SCALES.items():
        for name, sampler in SAMPLERS.items():  # alternated per cell, so box drift hits both alike
            cells = [f"{rows} rows {ms_per_call(rows, scale, args.calls, sampler):.2f} ms" for rows in args.rows]
            print(f"{shape:6s} {name:6s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()

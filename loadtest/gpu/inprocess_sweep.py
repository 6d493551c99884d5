"""The in-process half of the GPU load sweep: `InProcessPipeline` on the engine config `voxray serve` runs for the
sweep's Serve config and checkpoint (loadtest.gpu.sweep_config), c=1 TTFA, then Poisson arrivals of 7.2 s streams
per rate with loadtest.gpu_bench_pipeline's player (the arrivals, texts and seeds loadtest.gpu.cluster_sweep sends),
then HF generate() single stream on the same weights (gpu_bench's naive baseline). Writes one JSON of rows
(loadtest.gpu.sweep_compare). loadtest/gpu/sweep_run.sh runs it in its own process before the cluster starts,
so the GPU is free again when the cluster loads.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from cluster.pipeline import InProcessPipeline
from core.config import load_serve_config
from llm_stage.models.orpheus import TOKENS_PER_FRAME
from loadtest.gpu.sweep_compare import RateRow, is_saturated, playback_row
from loadtest.gpu.sweep_config import served_engine_config
from loadtest.gpu_bench import BenchRun, hf_generate_section
from loadtest.gpu_bench_pipeline import FRAME_S, TEXTS, RateRun, lone_ttfa_s, play_rate, rate_summary

NUM_LONE = 4  # c=1 requests before the sweep: the first warms up, the median of the rest is reported


def row_of(rate_rps: float, streams: RateRun, wall_s: float, cap_s: float) -> RateRow:
    """The rate as a sweep_compare row: streams never sent (the cap came first) count as never playing."""
    unsent = len(streams.arrivals_s) - len(streams.trackers)
    ttfas = [tracker.ttfa_s for tracker in streams.trackers.values()] + [None] * unsent
    viable = [t.is_viable and req_id in streams.finished for req_id, t in streams.trackers.items()] + [False] * unsent
    return playback_row(rate_rps, ttfas, viable, streams.peak_active, streams.audio_s, wall_s, wall_s >= cap_s)


def sweep(pipe: InProcessPipeline, args: argparse.Namespace, end_s: float, out: dict) -> None:
    """Rates in increasing order into `out` (saved after each), each within its share of the time to `end_s` (at
    most --rate-cap-s); after a saturated rate the higher ones are skipped, as the cluster's are."""
    rows, details, saturated = [], {}, False
    out["rows"], out["rate_details"] = rows, details
    rates = sorted(args.rates)
    for index, rate in enumerate(rates):
        cap_s = min(args.rate_cap_s, (end_s - time.monotonic()) / (len(rates) - index))
        if saturated or cap_s < args.arrival_s:
            rows.append(RateRow(rate_rps=rate, skipped="saturated below" if saturated else "out of time"))
            continue
        streams, wall_s = play_rate(pipe, rate, args, cap_s)
        rows.append(row_of(rate, streams, wall_s, cap_s))
        details[f"{rate:g}"] = rate_summary(streams, wall_s, cap_s)
        print(f"[in-process] {rate:g} req/s: {asdict(rows[-1])}", flush=True)
        saturated = is_saturated(rows[-1], args.stop_p90_ttfa_s)
        save(out, args.out)


def save(out: dict, path: Path) -> None:
    """The report so far (rows as dicts), replaced atomically: a run killed later keeps what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(out, indent=1, default=lambda o: asdict(o) if isinstance(o, RateRow) else str(o)))
    scratch.replace(path)


def naive_baseline(adapter, device: str, tokens: int) -> dict:
    """gpu_bench's HF generate() section on this pipeline's weights (one stream, Orpheus' sampling, LLM only)."""
    run = BenchRun(argparse.Namespace(device=device, hf_tokens=tokens), _adapter=adapter)
    return hf_generate_section(run)


def run(args: argparse.Namespace) -> dict:
    start = time.monotonic()
    end_s = start + args.budget_s
    config = served_engine_config(load_serve_config(args.config), args.model, args.codec)
    out = {"engine": config.model_dump(mode="json"), "rates_rps": sorted(args.rates), "arrival_s": args.arrival_s,
           "max_tokens": args.max_tokens, "audio_s_per_stream": round(args.max_tokens / TOKENS_PER_FRAME * FRAME_S, 2),
           "rows": []}  # fmt: skip
    pipe = InProcessPipeline(config)
    out["built_s"] = round(time.monotonic() - start, 1)
    adapter = pipe.llm.engine.adapter
    try:
        lone = [lone_ttfa_s(pipe, f"c1-{i}", TEXTS[i % len(TEXTS)], args.max_tokens) for i in range(NUM_LONE)]
        out["c1_ttfa_s"] = lone
        warm = [t for t in lone[1:] if t is not None]
        out["c1_warm_ttfa_s"] = round(statistics.median(warm), 4) if warm else None
        sweep(pipe, args, end_s - args.hf_reserve_s, out)
    finally:
        pipe.close()
    del pipe
    gc.collect()
    if config.model.device.startswith("cuda"):
        torch.cuda.empty_cache()
    if config.model.device.startswith("cuda"):
        out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if args.hf_tokens > 0 and time.monotonic() < end_s:
        out["hf_generate"] = naive_baseline(adapter, config.model.device, args.hf_tokens)
    out["wall_s"] = round(time.monotonic() - start, 1)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, required=True, help="the sweep's ServeConfig YAML (sweep_config.py)")
    p.add_argument("--model", default=None, help="checkpoint dir or model name (as `voxray serve --model`)")
    p.add_argument("--codec", default=None, help="codec checkpoint dir (as `voxray serve --codec`)")
    p.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8, 16, 24], help="req/s")
    p.add_argument("--arrival-s", type=float, default=8.0, help="Poisson arrivals for this long per rate")
    p.add_argument("--rate-cap-s", type=float, default=20.0, help="wall time per rate at most")
    p.add_argument("--max-tokens", type=int, default=588, help="per stream (588 = 84 frames = 7.2 s)")
    p.add_argument("--stop-p90-ttfa-s", type=float, default=5.0, help="skip higher rates after a p90 past this")
    p.add_argument("--budget-s", type=float, default=180.0, help="the whole run, load included")
    p.add_argument("--hf-tokens", type=int, default=196, help="tokens of the HF generate() baseline (0 = none)")
    p.add_argument("--hf-reserve-s", type=float, default=20.0, help="kept from the sweep for the baseline")
    p.add_argument("--out", type=Path, required=True, help="the JSON written")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = run(args)
    save(out, args.out)
    print(f"[in-process] c=1 TTFA {out.get('c1_warm_ttfa_s')} s; HF generate {out.get('hf_generate')}; "
          f"{out['wall_s']} s; {args.out}", flush=True)  # fmt: skip
    return out


if __name__ == "__main__":
    main()

"""FCFS vs streaming-aware scheduling on the CPU preset, in-process, same Poisson arrivals.

Both engines run on wall-clock time with the batch deliberately smaller than the number of
concurrent streams (that is where the policy decides who waits). Every rate replays the same
arrival pattern, scaled in time (one seed per repeat), so a higher rate is strictly more load:
with a seed per rate, one rate's bursts could outweigh the next rate's and the p90s crossed.
Reports p50/p90 TTFA, % viable and worst underrun per rate, plus throughput-mode x-real-time,
as JSON and a table.
Run: `.venv/bin/python -m loadtest.policy_bench --rates 0.5 1 1.5 2 --requests 24 --repeats 2`
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.batch import BatchItem, run_batch
from cluster.config import CacheConfig, DetokConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.pipeline import InProcessPipeline
from router.playback import PlaybackTracker

TEXTS = ["Hello there.", "The quick brown fox jumps over the lazy dog.", "Streaming speech, one chunk at a time."]


@dataclass(frozen=True)
class RunResult:
    policy: str
    rate: float
    repeat: int
    p50_ttfa_s: float
    p90_ttfa_s: float
    viable_pct: float
    worst_underrun_s: float


def bench_config(policy: str, batch: int, slots: int, first_chunk_frames: int = 4) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(torch_threads=1),
        cache=CacheConfig(num_slots=slots, max_seq_len=1024),
        scheduler=SchedulerConfig(policy=policy, max_batch_size=batch),
        detok=DetokConfig(first_chunk_frames=first_chunk_frames),
    )


def arrivals(rate: float, count: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def run_rate(
    pipeline: InProcessPipeline, policy: str, rate: float, count: int, max_tokens: int, seed: int, repeat: int = 0
) -> RunResult:
    schedule = arrivals(rate, count, seed)
    trackers: dict[str, PlaybackTracker] = {}
    start = time.monotonic()
    while len(trackers) < count or pipeline.has_work:
        now = time.monotonic() - start
        while len(trackers) < count and schedule[len(trackers)] <= now:
            req_id = f"{policy}-{rate}-{len(trackers)}"
            trackers[req_id] = PlaybackTracker(time.monotonic())
            pipeline.submit(req_id, TEXTS[len(trackers) % len(TEXTS)], None, {"max_tokens": max_tokens, "seed": seed})
        if not pipeline.has_work:
            time.sleep(0.002)
            continue
        for chunk in pipeline.step():
            trackers[chunk.req_id].on_chunk(time.monotonic(), chunk.duration_s)
    return summarize(policy, rate, repeat, list(trackers.values()))


def summarize(policy: str, rate: float, repeat: int, trackers: list[PlaybackTracker]) -> RunResult:
    ttfas = sorted(t.ttfa_s for t in trackers if t.ttfa_s is not None)
    p90 = ttfas[min(len(ttfas) - 1, int(0.9 * len(ttfas)))]
    worst = max((max(t.underruns_s, default=0.0) for t in trackers), default=0.0)
    viable = 100.0 * sum(t.is_viable for t in trackers) / len(trackers)
    return RunResult(policy, rate, repeat, statistics.median(ttfas), p90, viable, worst)


def table(results: list[RunResult]) -> str:
    """Per policy and rate over the repeats: median p90 TTFA (min-max) and mean % viable (min-max)."""
    lines = ["| rate | policy | p90 TTFA, median (range) | viable, mean (range) |", "|---|---|---|---|"]
    for rate in sorted({r.rate for r in results}):
        for policy in sorted({r.policy for r in results}):
            runs = [r for r in results if r.rate == rate and r.policy == policy]
            p90s, viable = [r.p90_ttfa_s for r in runs], [r.viable_pct for r in runs]
            lines.append(
                f"| {rate} | {policy} | {statistics.median(p90s):.2f} s ({min(p90s):.2f}-{max(p90s):.2f}) "
                f"| {statistics.mean(viable):.1f}% ({min(viable):.0f}-{max(viable):.0f}) |"
            )
    return "\n".join(lines)


def throughput_x_real_time(max_tokens: int, count: int, slots: int) -> dict[str, float]:
    """Same model: x-real-time of throughput mode (all at once) vs streaming mode."""
    items = [BatchItem(f"t{i}", TEXTS[i % len(TEXTS)], None) for i in range(count)]
    out = {}
    for policy in ("throughput", "streaming"):
        config = bench_config(policy, batch=slots, slots=slots)
        out_dir = Path(tempfile.gettempdir()) / f"voxray-policy-bench-{policy}"
        report = run_batch(config, items, out_dir, {"max_tokens": max_tokens})
        out[policy] = report.x_real_time
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=1, help="runs per rate and policy (new arrival times each)")
    parser.add_argument("--seed", type=int, default=7, help="arrival pattern of repeat 0 (seed + k: repeat k)")
    parser.add_argument("--max-tokens", type=int, default=168, help="168 = 24 frames = 2.05 s of audio")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--first-chunk-frames", type=int, default=4, help="as deployments/configs/cpu.yaml")
    parser.add_argument("--xrt-requests", type=int, default=32, help="requests of the x-real-time comparison")
    parser.add_argument("--xrt-max-tokens", type=int, default=336, help="336 = 48 frames = 4.1 s of audio")
    parser.add_argument("--xrt-only", action="store_true", help="skip the rate sweep")
    parser.add_argument("--out", default="loadtest/results/policy_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    pipelines = {
        p: InProcessPipeline(bench_config(p, args.batch, args.slots, args.first_chunk_frames))
        for p in ("fcfs", "streaming")
    }
    # both policies back to back at each rate, so machine noise (it drifts by ~25% here) hits both alike
    for repeat in range(args.repeats):
        for rate in [] if args.xrt_only else args.rates:
            for policy, pipeline in pipelines.items():
                seed = args.seed + repeat  # the same pattern at every rate, scaled by 1 / rate
                result = run_rate(pipeline, policy, rate, args.requests, args.max_tokens, seed, repeat)
                results.append(result)
                print(result, flush=True)
    for pipeline in pipelines.values():
        pipeline.close()
    if results:
        print(table(results))
    xrt = throughput_x_real_time(args.xrt_max_tokens, args.xrt_requests, args.slots)
    print(f"x-real-time: {xrt}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"args": vars(args), "results": [r.__dict__ for r in results], "x_real_time": xrt}, handle, indent=1)


if __name__ == "__main__":
    main()

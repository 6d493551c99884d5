"""FCFS vs streaming-aware scheduling on the CPU preset, in-process, same Poisson arrivals.

Both engines run on wall-clock time with the batch deliberately smaller than the number of
concurrent streams (that is where the policy decides who waits). Every rate replays the same
arrival pattern, scaled in time (one seed per repeat), so a higher rate is strictly more load:
with a seed per rate, one rate's bursts could outweigh the next rate's and the p90s crossed.
`--loads` sets each rate as a share of the requests per second the pipeline finishes when all
arrive at once, measured at the start of every repeat (`capacity_req_s`): the same command
then means the same load on a machine 5x faster, or on this one after its speed drifted.
Reports p50/p90 TTFA, % viable and worst underrun per rate, where FCFS's p90 doubles and where
streaming stands there, plus throughput-mode x-real-time, as JSON and a table.
Run: `.venv/bin/python -m loadtest.policy_bench --requests 48 --repeats 6` (loads 0.1 0.4 0.5 0.6 0.7)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.batch import BatchItem, run_batch
from cluster.pipeline import InProcessPipeline
from core.config import CacheConfig, DetokConfig, EngineConfig, ModelConfig, SchedulerConfig
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
    load: float | None = None  # share of the measured capacity the rate was set to (`--loads`)

    @property
    def level(self) -> float:
        """What runs are grouped by: the load when the rate was set as one, else the rate."""
        return self.rate if self.load is None else self.load


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


def capacity_req_s(pipeline: InProcessPipeline, count: int, max_tokens: int, tag: str = "") -> float:
    """Requests per second the pipeline finishes when `count` arrive at once (no row ever idle):
    the machine's speed now, in the unit rates are set in."""
    start = time.monotonic()
    for i in range(count):
        pipeline.submit(f"capacity{tag}-{i}", TEXTS[i % len(TEXTS)], None, {"max_tokens": max_tokens, "seed": 0})
    while pipeline.has_work:
        pipeline.step()
    return count / (time.monotonic() - start)


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


def report(results: list[RunResult]) -> str:
    """Per level (load, or rate) and policy over the repeats: p90 TTFA median and mean, % viable
    mean and min; then the issue's target: the first level where FCFS's median p90 is 2x its
    lowest level's, and where streaming stands there against its own lowest-level p90."""
    unit = "load" if results and results[0].load is not None else "rate"
    lines = [f"| {unit} | policy | p90 TTFA median | p90 mean | viable mean (min) |", "|---|---|---|---|---|"]
    median: dict[tuple[str, float], float] = {}
    viable: dict[tuple[str, float], list[float]] = {}
    for level in sorted({r.level for r in results}):
        for policy in sorted({r.policy for r in results}):
            runs = [r for r in results if r.level == level and r.policy == policy]
            if not runs:
                continue
            p90s = [r.p90_ttfa_s for r in runs]
            median[policy, level], viable[policy, level] = statistics.median(p90s), [r.viable_pct for r in runs]
            lines.append(
                f"| {level} | {policy} | {median[policy, level]:.3f} s | {statistics.mean(p90s):.3f} s "
                f"| {statistics.mean(viable[policy, level]):.1f}% ({min(viable[policy, level]):.0f}) |"
            )
    levels = sorted({level for _, level in median})
    low = levels[0] if levels else None
    if ("fcfs", low) in median and ("streaming", low) in median:
        doubled = [level for level in levels if median["fcfs", level] >= 2 * median["fcfs", low]]
        if doubled and ("streaming", doubled[0]) in median:
            at = doubled[0]
            ratio = median["streaming", at] / median["streaming", low]
            lines.append(
                f"\nFCFS p90 doubles by {unit} {at}; streaming there: {ratio:.2f}x its low-{unit} p90, "
                f"{statistics.mean(viable['streaming', at]):.1f}% viable (min {min(viable['streaming', at]):.0f}%)"
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
    levels = parser.add_mutually_exclusive_group()
    levels.add_argument("--rates", type=float, nargs="+", help="requests per second")
    levels.add_argument(
        "--loads", type=float, nargs="+", help="shares of the capacity measured each repeat (default 0.1-0.7)"
    )
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
    parser.add_argument("--capacity-requests", type=int, default=32, help="requests of each capacity measurement")
    parser.add_argument("--out", default="loadtest/results/policy_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    pipelines = {
        p: InProcessPipeline(bench_config(p, args.batch, args.slots, args.first_chunk_frames))
        for p in ("fcfs", "streaming")
    }
    loads = None if args.rates else (args.loads or [0.1, 0.4, 0.5, 0.6, 0.7])
    args.loads, capacities = loads, []
    # both policies back to back at each rate, so machine noise (it drifts by ~25% here) hits both alike
    for repeat in range(0 if args.xrt_only else args.repeats):
        rates = args.rates
        if loads is not None:
            capacity = capacity_req_s(pipelines["fcfs"], args.capacity_requests, args.max_tokens, f"-{repeat}")
            print(f"repeat {repeat}: capacity {capacity:.2f} req/s", flush=True)
            capacities.append(capacity)
            rates = [round(load * capacity, 3) for load in loads]
        for level, rate in enumerate(rates):
            for policy, pipeline in pipelines.items():
                seed = args.seed + repeat  # the same pattern at every rate, scaled by 1 / rate
                result = run_rate(pipeline, policy, rate, args.requests, args.max_tokens, seed, repeat)
                if loads is not None:
                    result = dataclasses.replace(result, load=loads[level])
                results.append(result)
                print(result, flush=True)
    for pipeline in pipelines.values():
        pipeline.close()
    if results:
        print(report(results))
    xrt = throughput_x_real_time(args.xrt_max_tokens, args.xrt_requests, args.slots)
    print(f"x-real-time: {xrt}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as handle:
        results_json = [r.__dict__ for r in results]
        record = {"args": vars(args), "capacity_req_s": capacities, "results": results_json, "x_real_time": xrt}
        json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()

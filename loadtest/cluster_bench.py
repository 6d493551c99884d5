"""The cluster against its own engine: the in-process pipeline and `voxray serve` (the CPU
config) at the same Poisson rates, prompts and seeds, one after the other in one run.

Reports capacity at SLO and peak audio throughput of each, their ratios (cluster / in-process)
and the cluster's per-chunk hop breakdown (from the stages' wall-clock stamps), as JSON and a
markdown table. `--admit-all` sweeps the cluster a second time admitting every request as the
in-process pipeline does (`admission.policy: fixed_cap` at the KV cap, a queue for every request
of a rate; every rate, as the in-process sweep runs past saturation too): the data path's own
cost apart from admission refusing load the pipeline plays late.
Usage: python -m loadtest.cluster_bench --rates 1 2 4 6 8 --out bench_out/cluster [--admit-all]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict
from pathlib import Path

import grpc
import yaml

from cluster.pipeline import InProcessPipeline
from core.config import load_serve_config
from loadtest.metrics import RateSummary, RequestRecord, capacity_at_slo, hop_breakdown, summarize
from loadtest.run_all import System, start_ready, stop
from loadtest.serve_voxray import CPU_CONFIG
from loadtest.sweep import SweepConfig, is_saturated, run_rate
from loadtest.workload import arrival_offsets_s, load_prompts, max_tokens_for
from protos import voxray_pb2_grpc

GRPC_PORT = 19140  # the HTTP port is the next one


def grpc_port() -> int:
    """The cluster's gRPC port: GRPC_PORT, moved by VOXRAY_TEST_PORT_OFFSET so that runs sharing a
    box (each with its own local Ray) do not collide."""
    return GRPC_PORT + int(os.environ.get("VOXRAY_TEST_PORT_OFFSET", "0"))


def in_process_rate(
    pipeline: InProcessPipeline, rate_rps: float, prompts: list[str], cfg: SweepConfig
) -> list[RequestRecord]:
    """The sweep's open loop (same arrival times, prompts and seeds as `sweep.run_rate`) on the
    in-process pipeline: one thread submits at each arrival time and steps the engines."""
    rng = random.Random(f"{cfg.seed}-{rate_rps}")
    offsets = arrival_offsets_s(
        rate_rps, cfg.duration_s, cfg.min_requests, cfg.max_requests, rng, cfg.process, cfg.gamma_cv
    )
    records: dict[str, RequestRecord] = {}
    sent_at: dict[str, float] = {}
    start_s = time.perf_counter()
    while len(records) < len(offsets) or pipeline.has_work:
        now = time.perf_counter() - start_s
        while len(records) < len(offsets) and offsets[len(records)] <= now:
            index = len(records)
            text = prompts[rng.randrange(len(prompts))]
            req_id = f"r{rate_rps}-{index}"
            records[req_id] = RequestRecord(
                text_chars=len(text), scheduled_at_s=offsets[index], send_lag_s=now - offsets[index]
            )
            sent_at[req_id] = time.perf_counter()
            sampling = {"max_tokens": max_tokens_for(text), "seed": cfg.seed * 100_000 + index}
            pipeline.submit(req_id, text, cfg.voice, sampling)
        if not pipeline.has_work:
            time.sleep(0.002)
            continue
        for chunk in pipeline.step():
            record = records[chunk.req_id]
            record.arrivals_s.append(time.perf_counter() - sent_at[chunk.req_id])
            record.durations_s.append(chunk.duration_s)
    return list(records.values())


def sweep_in_process(config_path: Path, cfg: SweepConfig) -> list[dict]:
    pipeline = InProcessPipeline(load_serve_config(config_path).engine)
    pipeline.synthesize("warm up", None, {"max_tokens": 28, "seed": 0})
    try:
        return _sweep(lambda rate: in_process_rate(pipeline, rate, load_prompts(), cfg), cfg, "in-process")
    finally:
        pipeline.close()


def sweep_cluster(
    config_path: Path, cfg: SweepConfig, log_dir: Path, every_rate: bool = False
) -> tuple[list[dict], float]:
    import sys

    port = grpc_port()
    command = [sys.executable, "-m", "loadtest.serve_voxray", "--grpc-port", str(port), "--http-port",
               str(port + 1), "--config", str(config_path)]  # fmt: skip
    system = System("voxray-cluster", port, command, 240.0)
    started = time.monotonic()
    proc = start_ready(system, log_dir, cfg.app_name)
    try:
        target = f"127.0.0.1:{port}"
        startup_s = time.monotonic() - started
        with grpc.insecure_channel(target) as channel:
            stub = voxray_pb2_grpc.SpeechStub(channel)
            label = "cluster admitting all" if every_rate else "cluster"
            return _sweep(lambda rate: run_rate(stub, rate, load_prompts(), cfg), cfg, label, every_rate), startup_s
    finally:
        stop(proc)


def admit_all_config(config_path: Path, out_dir: Path, max_requests: int) -> Path:
    """`config_path` with the admission the in-process pipeline has: none. Every stream runs once
    a KV slot is free (fixed_cap at the KV cap, a queue for every request of a rate)."""
    config = load_serve_config(config_path, check_files=False)
    admission = config.admission.model_copy(update={
        "policy": "fixed_cap", "max_streams_per_replica": config.engine.cache.num_slots,
        "max_queued_per_replica": max_requests,
    })  # fmt: skip
    path = out_dir / "admit_all.yaml"
    path.write_text(yaml.safe_dump(config.model_copy(update={"admission": admission}).model_dump(mode="json")))
    return path


def _sweep(run, cfg: SweepConfig, label: str, every_rate: bool = False) -> list[dict]:
    """Each rate in increasing order until saturated (`every_rate`: all of them, for the peak)."""
    steps = []
    for rate in sorted(cfg.rates_rps):
        step_start = time.monotonic()
        records = run(rate)
        wall_s = time.monotonic() - step_start
        summary = summarize(rate, records)
        steps.append({"summary": summary.to_json(), "wall_s": round(wall_s, 2), "audio_x": summary.audio_s / wall_s,
                      "hops": hop_breakdown(records)})  # fmt: skip
        print(f"[{label}] {rate:g} req/s: p90 TTFA {summary.ttfa_p90_s} viable {summary.pct_viable:.0f}% "
              f"audio {summary.audio_s / wall_s:.2f}x RT errors {summary.errors}", flush=True)  # fmt: skip
        if is_saturated(summary, cfg) and not every_rate:
            break
    return steps


def capacity(steps: list[dict], cfg: SweepConfig) -> float:
    summaries = [RateSummary(**s["summary"]) for s in steps]
    return capacity_at_slo(summaries, cfg.slo_ttfa_p90_s, cfg.min_pct_viable)


def report(inproc: list[dict], clus: list[dict], cfg: SweepConfig, admit_all: list[dict] | None = None) -> str:
    cap_in, cap_cl = capacity(inproc, cfg), capacity(clus, cfg)
    peak_in, peak_cl = max(s["audio_x"] for s in inproc), max(s["audio_x"] for s in clus)
    lines = [
        "| system | capacity at SLO (req/s) | peak audio (x RT) |", "|---|---|---|",
        f"| in-process | {cap_in:g} | {peak_in:.2f} |", f"| cluster | {cap_cl:g} | {peak_cl:.2f} |",
        f"| **cluster / in-process** | **{_ratio(cap_cl, cap_in)}** | **{peak_cl / peak_in:.2f}x** |",
    ]  # fmt: skip
    if admit_all:
        cap_all, peak_all = capacity(admit_all, cfg), max(s["audio_x"] for s in admit_all)
        lines += [f"| cluster admitting all | {cap_all:g} | {peak_all:.2f} |",
                  f"| **admitting all / in-process** | **{_ratio(cap_all, cap_in)}** "
                  f"| **{peak_all / peak_in:.2f}x** |"]  # fmt: skip
    lines += ["", "| rate | in-process p90 TTFA / viable / x RT | cluster p90 TTFA / viable / x RT |"
              + (" admitting all |" if admit_all else ""), "|---|---|---|" + ("---|" if admit_all else "")]  # fmt: skip
    columns = [{s["summary"]["rate_rps"]: s for s in steps} for steps in (clus, admit_all or []) if steps]
    for s in inproc:
        rate = s["summary"]["rate_rps"]
        cells = [_cell(by_rate[rate]) if rate in by_rate else "-" for by_rate in columns]
        lines.append(f"| {rate:g} | {_cell(s)} | " + " | ".join(cells) + " |")
    lines += ["", "cluster hops per chunk, p50 / p90 ms:", "", "| rate | " + " | ".join(_hop_names(clus)) + " |",
              "|---" * (1 + len(_hop_names(clus))) + "|"]  # fmt: skip
    for s in clus:
        cells = [f"{h['p50_ms']:.0f} / {h['p90_ms']:.0f}" for h in s["hops"].values()]
        lines.append(f"| {s['summary']['rate_rps']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _hop_names(steps: list[dict]) -> list[str]:
    return list(steps[0]["hops"]) if steps else []


def _cell(step: dict) -> str:
    s = step["summary"]
    p90 = "-" if s["ttfa_p90_s"] is None else f"{s['ttfa_p90_s']:.2f} s"
    return f"{p90} / {s['pct_viable']:.0f}% / {step['audio_x']:.2f}"


def _ratio(ours: float, base: float) -> str:
    return f"{ours / base:.2f}x" if base > 0 else "n/a"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--max-requests", type=int, default=60)
    p.add_argument("--config", type=Path, default=CPU_CONFIG)
    p.add_argument("--out", type=Path, default=Path("bench_out/cluster_bench"))
    p.add_argument("--admit-all", action="store_true", help="sweep the cluster again admitting every request")
    args = p.parse_args(argv)
    cfg = SweepConfig(rates_rps=tuple(args.rates), duration_s=args.duration_s, max_requests=args.max_requests)
    args.out.mkdir(parents=True, exist_ok=True)
    inproc = sweep_in_process(args.config, cfg)
    clus, startup_s = sweep_cluster(args.config, cfg, args.out)
    admit_all = None
    if args.admit_all:
        config_path = admit_all_config(args.config, args.out, args.max_requests)
        admit_all, _ = sweep_cluster(config_path, cfg, args.out, every_rate=True)
    result = {"config": asdict(cfg), "in_process": inproc, "cluster": clus, "cluster_startup_s": startup_s,
              "cluster_admitting_all": admit_all}  # fmt: skip
    (args.out / "cluster_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    markdown = report(inproc, clus, cfg, admit_all)
    (args.out / "cluster_bench.md").write_text(markdown)
    print(markdown)
    return result


if __name__ == "__main__":
    main()

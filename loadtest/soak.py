"""Soak: a real `voxray serve` (the 2-replica CPU config, as the chaos bench; `--replicas 1`: one of
each stage, the test's short soak) under Poisson arrivals
at ~50% of its capacity for `--duration-s`, then idle for `--idle-tail-s`; every `--sample-s` it
samples the RSS and open file descriptors of every process of the server's tree (the `voxray serve`
driver, GCS, raylet, dashboard and agents, Serve's controller and proxy, the Router and each stage
replica), the object store's use and the VoxRay gauges from the Prometheus endpoint. Writes the
time series (JSON), a plot and the verdict (`loadtest.soak_verdict`): nothing grew past warm-up,
the stream gauges back to zero when idle.
Usage: python -m loadtest.soak --duration-s 3600 --sample-s 30 --warm-up-s 600 --out bench_out/soak/soak.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

import psutil

from core.config import ServeConfig
from loadtest.chaos_bench import drive, summarize
from loadtest.chaos_streams import plan_streams
from loadtest.cluster_process import (
    join_cluster,
    leave_cluster,
    metrics_export_port,
    process_role,
    running_server,
    scrape_metrics,
    tree_processes,
    two_replica_config,
    wait_for_metrics,
)
from loadtest.soak_verdict import Sample, gauge_series, process_series, verdict

SOAK_RATE_RPS = 0.15  # ~50% of the 2-replica CPU config's capacity at SLO (see chaos_bench.DEFAULT_RATE_RPS)
METRICS_READY_TIMEOUT_S = 120.0  # the soak's clock starts once the stages' gauges are exported (or after this)
METRIC_PREFIXES = ("ray_voxray_", "ray_object_store_used_memory", "ray_object_store_num_local_objects")


def sample_processes(root_pid: int) -> dict[str, float]:
    """RSS (MB) and open fds of every live process of the tree, each named `role [pid]`."""
    values: dict[str, float] = {}
    for proc in tree_processes(root_pid):
        with contextlib.suppress(psutil.Error), proc.oneshot():  # a process may end between listing and reading
            values |= process_series(f"{process_role(proc, root_pid)} [{proc.pid}]", proc.memory_info().rss,
                                     proc.num_fds())  # fmt: skip
    values["num_processes"] = float(sum(name.startswith("rss_mb/") for name in values))
    values["rss_mb/total"] = sum(v for name, v in values.items() if name.startswith("rss_mb/"))
    return values


def take_sample(root_pid: int, metrics_port: int, t_s: float, phase: str) -> Sample:
    values = sample_processes(root_pid)
    with contextlib.suppress(Exception):  # a missed scrape leaves the gauges out of this sample, not the run
        values |= gauge_series(scrape_metrics(metrics_port, METRIC_PREFIXES))
    return Sample(round(t_s, 2), phase, values)


def sample_until(root_pid: int, metrics_port: int, t0: float, args: argparse.Namespace) -> list[Sample]:
    """One sample every `sample_s` from the start until the end of the idle tail."""
    samples: list[Sample] = []
    end_s = args.duration_s + args.idle_tail_s
    k = 0
    while k * args.sample_s <= end_s + 1e-9:
        time.sleep(max(0.0, t0 + k * args.sample_s - time.monotonic()))
        t_s = time.monotonic() - t0
        samples.append(take_sample(root_pid, metrics_port, t_s, "load" if t_s < args.duration_s else "idle"))
        k += 1
    return samples


def _play_all(specs: list, server, timeout_s: float, outcome: dict) -> None:
    """The load: every stream at its time, no faults; the results land in `outcome`."""
    outcome["results"], _ = drive(specs, [], server, timeout_s)


def serve_config(replicas: int, grpc_port: int, http_port: int) -> ServeConfig:
    """The CPU config with one replica of each stage, or the 2-replica one (`two_replica_config`)."""
    from loadtest.serve_voxray import loadtest_config

    return two_replica_config(grpc_port, http_port) if replicas == 2 else loadtest_config(grpc_port, http_port)


def run(args: argparse.Namespace) -> dict:
    config = serve_config(args.replicas, args.grpc_port, args.http_port)
    specs = plan_streams(args.rate, args.duration_s, args.incremental_share, args.seed)
    outcome: dict = {}
    with running_server(config, args.out.parent / f"{args.out.stem}-server") as server:
        join_cluster(server)
        port = metrics_export_port()
        leave_cluster()  # the soak needs no driver: psutil and the Prometheus endpoint
        waited_s = wait_for_metrics(port, "ray_voxray_", METRICS_READY_TIMEOUT_S)
        print(f"metrics endpoint: {'no VoxRay series yet' if waited_s is None else f'ready after {waited_s:.1f} s'}",
              flush=True)  # fmt: skip
        t0 = time.monotonic()
        load = threading.Thread(target=_play_all, args=(specs, server, args.request_timeout_s, outcome))
        load.start()
        samples = sample_until(server.proc.pid, port, t0, args)
        load.join(timeout=args.request_timeout_s + 30)
    window_s = args.window_samples * args.sample_s
    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "loadavg_1m_after": os.getloadavg()[0],
        "verdict": verdict(samples, args.warm_up_s, args.duration_s, window_s, args.tolerance_pct),
        "streams": summarize(outcome.get("results", []), [], []),
        "samples": [asdict(s) for s in samples],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    from loadtest.plots import plot_soak

    plot = plot_soak(report["samples"], args.out.with_suffix(".png"), args.warm_up_s, args.duration_s)
    print(format_verdict(report), flush=True)
    print(f"JSON {args.out}; plot {plot}")
    return report


def format_verdict(report: dict) -> str:
    v, streams = report["verdict"], report["streams"]
    lines = [f"streams: {streams['sent']} sent, {streams['refused']} refused, {streams['finished']}/"
             f"{streams['admitted']} admitted finished, viable {streams['pct_viable']}% of finished"]  # fmt: skip
    worst = v["worst"]
    if worst is not None:
        lines.append(f"worst series: {worst['series']} {worst['at_warm_up']} -> {worst['at_end']} "
                     f"({worst['growth_pct']:+.2f}%, allowed +{worst['allowed']})")  # fmt: skip
    lines += [f"GREW: {g['series']} {g['at_warm_up']} -> {g['at_end']} ({g['growth_pct']:+.2f}%)" for g in v["grown"]]
    lines.append(f"processes after warm-up: appeared {v['processes']['appeared']}, gone {v['processes']['gone']}")
    lines.append(f"stream gauges, last scraped values: {v['idle_gauges']}; still scraped at the end: "
                 f"{v['gauges_scraped_at_end']}")  # fmt: skip
    flat = "flat" if v["flat"] else "NOT flat"
    idle = "gauges zero when idle" if v["gauges_zero_when_idle"] else "gauges NOT zero when idle"
    lines.append(f"verdict: {'OK' if v['ok'] else 'FAIL'} ({flat} over {v['series_checked']} series, {idle})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=SOAK_RATE_RPS, help="Poisson arrivals, req/s (~50%% of capacity)")
    p.add_argument("--replicas", type=int, choices=(1, 2), default=2, help="replicas of each stage")
    p.add_argument("--duration-s", type=float, default=3600.0, help="seconds of load")
    p.add_argument("--sample-s", type=float, default=30.0, help="one sample this often")
    p.add_argument("--warm-up-s", type=float, default=600.0, help="levels are compared against this moment's")
    p.add_argument("--idle-tail-s", type=float, default=60.0, help="sampling on after the load; gauges must be 0")
    p.add_argument("--window-samples", type=int, default=3, help="a level is the median of this many samples")
    p.add_argument("--tolerance-pct", type=float, default=5.0, help="growth allowed past warm-up")
    p.add_argument("--incremental-share", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--grpc-port", type=int, default=19410)
    p.add_argument("--http-port", type=int, default=19411)
    p.add_argument("--out", type=Path, default=Path("bench_out/soak/soak.json"))
    args = p.parse_args(argv)
    if args.warm_up_s + args.window_samples * args.sample_s > args.duration_s:
        p.error("--warm-up-s plus the level window must end before --duration-s")
    return args


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()

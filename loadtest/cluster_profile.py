"""Where the cluster's CPU goes under load: `voxray serve` (the CPU config) at one Poisson rate,
with the CPU seconds of every process of the server's tree and of every thread of the replicas
(from /proc, so Ray's C++ threads count too), and optionally a py-spy profile of each replica.

Usage: python -m loadtest.cluster_profile --rate 6 --duration-s 15 --py-spy /path/to/py-spy
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import grpc

from loadtest.cluster_bench import grpc_port
from loadtest.metrics import summarize
from loadtest.run_all import System, start_ready, stop
from loadtest.serve_voxray import CPU_CONFIG
from loadtest.sweep import SweepConfig, run_rate
from loadtest.workload import load_prompts
from protos import voxray_pb2_grpc

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
REPLICAS = ("Router", "LLMStage", "DetokStage")
ACTOR_PREFIXES = ("ray::ServeReplica", "ray::ServeController", "ray::ProxyActor")  # Ray workers: Serve's actors


def _stat_fields(path: str) -> list[str]:
    """Fields of a /proc stat file after the command name (which may hold spaces)."""
    with open(path) as f:
        text = f.read()
    return text[text.rindex(")") + 2 :].split()


def cpu_s(path: str) -> float:
    """utime + stime of a /proc/<pid>[/task/<tid>]/stat, in seconds."""
    fields = _stat_fields(path)
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def process_tree(root_pid: int) -> dict[int, str]:
    """pid -> command line of `root_pid` and all its descendants."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children[int(_stat_fields(f"/proc/{entry}/stat")[1])].append(int(entry))
            except (OSError, ValueError):
                continue
    tree, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                tree[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
        except OSError:
            continue
        todo += children.get(pid, [])
    return tree


def snapshot(pids: dict[int, str]) -> dict[str, float]:
    """CPU seconds per process ("pid cmd") and per thread of the replicas ("pid/tid name")."""
    out: dict[str, float] = {}
    for pid, cmd in pids.items():
        try:
            out[f"{pid} {cmd}"] = cpu_s(f"/proc/{pid}/stat")
            if any(name in cmd for name in REPLICAS):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/comm") as f:
                        name = f.read().strip()
                    out[f"{pid}/{tid} {name}"] = cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
    return out


def grouped(pct_core: dict[str, float]) -> dict[str, float]:
    """Percent of a core per group: each replica's busiest thread (its engine thread; the Router's
    busiest), the rest of each replica, and every other process of the tree (Ray's own, the driver)."""
    groups: dict[str, float] = defaultdict(float)
    busiest: dict[str, float] = {}
    for key, pct in pct_core.items():
        ident, _, cmd = key.partition(" ")
        replica = next((name for name in REPLICAS if f":{name}" in cmd), None)
        if "/" in ident:
            continue
        if replica is None:
            groups["other processes (Ray's own, the driver)"] += pct
            continue
        pid = ident
        threads = [v for k, v in pct_core.items() if k.startswith(f"{pid}/")]
        busiest[replica] = max(threads, default=0.0)
        groups[f"{replica} busiest thread"] += busiest[replica]
        groups[f"{replica} other threads"] += pct - busiest[replica]
    return {k: round(v, 1) for k, v in groups.items()}


def replica_pids(pids: dict[int, str]) -> dict[str, int]:
    return {name: pid for pid, cmd in pids.items() for name in REPLICAS if f":{name}" in cmd}


def profile(args: argparse.Namespace) -> dict:
    port = grpc_port()
    command = [sys.executable, "-m", "loadtest.serve_voxray", "--grpc-port", str(port), "--http-port",
               str(port + 1), "--config", str(args.config)]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = SweepConfig(rates_rps=(args.rate,), duration_s=args.duration_s, max_requests=args.max_requests)
    proc = start_ready(System("voxray-cluster", port, command, 240.0), args.out, cfg.app_name)
    try:
        target = f"127.0.0.1:{port}"
        pids = process_tree(proc.pid)
        spies = _start_py_spy(args, replica_pids(pids))
        load_before, before, wall_start = os.getloadavg()[0], snapshot(pids), time.monotonic()
        with grpc.insecure_channel(target) as channel:
            records = run_rate(voxray_pb2_grpc.SpeechStub(channel), args.rate, load_prompts(), cfg)
        wall_s, after = time.monotonic() - wall_start, snapshot(pids)
        for spy in spies:
            spy.wait()
        summary = summarize(args.rate, records)
        used = sorted(((key, after[key] - before.get(key, 0.0)) for key in after), key=lambda kv: -kv[1])
        result = {
            "rate_rps": args.rate, "wall_s": wall_s, "audio_x": summary.audio_s / wall_s,
            "errors": summary.errors, "loadavg_1m": [load_before, os.getloadavg()[0]],
            "pct_core": {key: round(100 * cpu / wall_s, 1) for key, cpu in used if cpu > 0},
        }  # fmt: skip
        result["groups"] = grouped(result["pct_core"])
        (args.out / "cluster_profile.json").write_text(json.dumps(result, indent=1) + "\n")
        return result
    finally:
        stop(proc)


def renice(pids: list[int], niceness: int) -> None:
    """Every thread of `pids` at `niceness` (Linux niceness is per thread; new ones inherit it)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)


def renice_ab(args: argparse.Namespace) -> list[dict]:
    """One server, the rate run again and again with its Ray workers reniced in turn to each of
    `args.renice_ab` (A/B/A/B on one box: the cluster is the same, only the priority differs)."""
    port = grpc_port()
    command = [sys.executable, "-m", "loadtest.serve_voxray", "--grpc-port", str(port), "--http-port",
               str(port + 1), "--config", str(args.config)]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = SweepConfig(rates_rps=(args.rate,), duration_s=args.duration_s, max_requests=args.max_requests)
    proc = start_ready(System("voxray-cluster", port, command, 240.0), args.out, cfg.app_name)
    rows = []
    try:
        target = f"127.0.0.1:{port}"
        actors = [pid for pid, cmd in process_tree(proc.pid).items() if cmd.startswith(ACTOR_PREFIXES)]
        for _ in range(args.repeats):
            for niceness in args.renice_ab:
                renice(actors, niceness)
                load_s, start_s = os.getloadavg()[0], time.monotonic()
                with grpc.insecure_channel(target) as channel:
                    records = run_rate(voxray_pb2_grpc.SpeechStub(channel), args.rate, load_prompts(), cfg)
                summary, wall_s = summarize(args.rate, records), time.monotonic() - start_s
                rows.append({"niceness": niceness, "audio_x": round(summary.audio_s / wall_s, 2),
                             "errors": summary.errors, "pct_viable": round(summary.pct_viable),
                             "loadavg_1m": round(load_s, 1)})  # fmt: skip
                print(rows[-1], flush=True)
                time.sleep(5.0)  # the last streams' cancels and stats settle
    finally:
        stop(proc)
    (args.out / "renice_ab.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def _start_py_spy(args: argparse.Namespace, replicas: dict[str, int]) -> list[subprocess.Popen]:
    if not args.py_spy:
        return []
    spies = []
    for name, pid in replicas.items():
        out = str(args.out / f"{name}.pyspy.txt")
        command = [args.py_spy, "record", "--nonblocking", "-r", "50", "-d", str(int(args.duration_s)), "-f", "raw",
                   "-o", out, "-p", str(pid)]  # fmt: skip
        spies.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=6.0)
    p.add_argument("--duration-s", type=float, default=15.0)
    p.add_argument("--max-requests", type=int, default=60)
    p.add_argument("--config", type=Path, default=CPU_CONFIG)
    p.add_argument("--py-spy", default="", help="path of a py-spy binary (profiles each replica)")
    p.add_argument("--out", type=Path, default=Path("bench_out/cluster_profile"))
    p.add_argument("--renice-ab", type=int, nargs="*", help="A/B the Ray workers' niceness instead (e.g. 15 0)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of --renice-ab")
    args = p.parse_args(argv)
    if args.renice_ab:
        return {"renice_ab": renice_ab(args)}
    result = profile(args)
    print(f"{result['rate_rps']:g} req/s: {result['audio_x']:.2f}x RT, errors {result['errors']}, "
          f"load average {result['loadavg_1m']}")  # fmt: skip
    for key, pct in list(result["groups"].items()) + list(result["pct_core"].items())[:30]:
        print(f"{pct:6.1f}%  {key}")
    return result


if __name__ == "__main__":
    main()

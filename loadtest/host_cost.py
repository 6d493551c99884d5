"""What one stream costs the box's CPUs beside the engines, measured on a real `voxray serve` (issue 40's
planner calibration for clusters whose stages share the host's cores).

Serves a configuration (`loadtest.plan_configs.serve_config`, one LLM and one detok replica) as a process,
then sends the sweep's prompts one at a time (c=1, so every figure is the cost of work, not of waiting) in
two sets, the shortest third and the longest third of the prompts (few and many chunks a stream), and reads
the CPU time (user + system) of every process of the server's tree and of this client before and after each
set, plus the tree's CPU over `IDLE_SPELLS` idle spells (Ray's daemons, Serve's controller: the background;
one before the sets, one between them and the closed-loop levels, one after the levels). Per set:

- the LLM replica's CPU per token at one row (the engine step and its serving loop) and the detok
  replica's per chunk;
- the host's CPU (every other process: the Router, Serve's proxy, the controller, GCS, raylet, the client)
  less the background over the same seconds, per stream;
- the time to first audio, p50.

Solving the two sets for (per stream, per chunk) splits the host's CPU into a start's cost and a chunk's.
Then closed-loop clients at 2, 4, 8 and 12 at once, the sequence run `LEVEL_ROUNDS` times: the LLM replica's
serving-loop step by rows (each size's mean cycle in its loop trace, the sets and the first round), and each
level's host CPU against the streams and chunks it served (`split_host_at_load`: all levels together, and
each round alone). `calibration_host` turns that into the calibration's `host` section
(`cluster.planner.calibration.HostCost`), `calibration_host_range` into `host_range`: the cheapest and the
dearest host the spells and the rounds measured (two calibrations an hour apart differed by a third in
capacity from these terms alone, docs/experiments/2026-12-05-capacity-planner.md).
Takes about 4 min (about 3 before the spells and rounds were repeated). Starts Ray.
Usage: python -m loadtest.host_cost --out bench_out/host_cost [--requests 12] [--idle-spells 3] [--level-rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from dataclasses import asdict
from pathlib import Path

import grpc
import psutil

from core.config import DetokConfig
from loadtest.cluster_process import join_cluster, leave_cluster, process_role, running_server, tree_processes
from loadtest.host_fit import HostCost, SaturatedLoad, SetCost, host_cost_of, report
from loadtest.sweep import SweepConfig, run_one, wait_ready
from loadtest.workload import ORPHEUS_FRAME_RATE_HZ, load_prompts
from protos import voxray_pb2_grpc

IDLE_S = 8.0  # the background's CPU is read over each idle spell this long
IDLE_SPELLS = 3  # before the c=1 sets, between them and the levels, after the levels
SETTLE_S = 2.0  # the server winding down after the last level's streams ended, before the last idle spell
LOAD_LEVELS = (2, 4, 8, 12)  # closed-loop clients at once, for the serving loop's step by rows
LEVEL_S = 10.0
LEVEL_ROUNDS = 2  # runs of LOAD_LEVELS: the host fit's spread between rounds
LLM_ROLE = "ray::ServeReplica:voxray:LLMStage"
DETOK_ROLE = "ray::ServeReplica:voxray:DetokStage"


def cpu_seconds_by_role(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every live process of the tree, summed by role."""
    totals: dict[str, float] = {}
    for proc in tree_processes(root_pid):
        try:
            times = proc.cpu_times()
            role = process_role(proc, root_pid)
        except psutil.Error:  # ended between listing and reading
            continue
        totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


def client_cpu_s() -> float:
    """This process's CPU seconds, with its ended children's (the box-speed probes it spawns are ours)."""
    times = psutil.Process().cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def background_cores(root_pid: int, idle_s: float = IDLE_S) -> float:
    before, t0 = sum(cpu_seconds_by_role(root_pid).values()), time.monotonic()
    time.sleep(idle_s)
    return (sum(cpu_seconds_by_role(root_pid).values()) - before) / (time.monotonic() - t0)


def idle_spells_now(root_pid: int, count: int, settle_s: float = 0.0) -> list[float]:
    """`count` idle spells back to back (`background_cores`), after `settle_s` of the server winding down
    (none waited when `count` is 0)."""
    if count > 0 and settle_s > 0:
        time.sleep(settle_s)
    return [background_cores(root_pid) for _ in range(count)]


def spell_counts(idle_spells: int) -> tuple[int, int, int]:
    """How many of `idle_spells` fall (before the c=1 sets, between them and the levels, after the levels):
    one before, the last after, the rest between."""
    if idle_spells < 1:
        raise ValueError(f"idle_spells must be >= 1, got {idle_spells}")
    after = 1 if idle_spells >= 2 else 0
    return 1, idle_spells - 1 - after, after


def idle_background(config, scratch: Path) -> float:  # config: core.config.ServeConfig
    """The idle cores of `config` served (its replicas warmed by a few streams first): a cluster of more
    replicas idles at more (each replica's process, the controller's and GCS's upkeep of it)."""
    cfg = SweepConfig(app_name=config.app_name, request_timeout_s=60.0)
    with running_server(config, scratch) as server:
        wait_ready(server.grpc_target, config.app_name)
        warm(server.grpc_target, prompt_sets(2)[0] * 2, cfg)
        return background_cores(server.proc.pid)


def warm(target: str, texts: list[str], cfg: SweepConfig) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        for i, text in enumerate(texts):
            run_one(stub, text, i, cfg)


def run_set(name: str, texts: list[str], target: str, root_pid: int, cfg: SweepConfig) -> SetCost:
    """Send `texts` one at a time; the CPU each group of processes spent on them (the host's with the
    background still in: `less_background` takes it off once every idle spell is read)."""
    before, client_before, t0 = cpu_seconds_by_role(root_pid), client_cpu_s(), time.monotonic()
    records = []
    with grpc.insecure_channel(target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        for i, text in enumerate(texts):
            records.append(run_one(stub, text, 1000 + i, cfg))
    wall_s = time.monotonic() - t0
    after, client_after = cpu_seconds_by_role(root_pid), client_cpu_s()
    spent = {role: after.get(role, 0.0) - before.get(role, 0.0) for role in after}
    failed = [r.error for r in records if not r.is_ok]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests failed ({failed[:3]}); the costs would be wrong")
    spent["client"] = client_after - client_before
    by_role = {role: round(cpu_s, 4) for role, cpu_s in sorted(spent.items(), key=lambda kv: -kv[1])}
    llm_s, detok_s = spent.pop(LLM_ROLE, 0.0), spent.pop(DETOK_ROLE, 0.0)
    return SetCost(
        name=name, streams=len(texts), chunks=sum(len(r.durations_s) for r in records),
        tokens=sum(cfg.max_tokens(t) for t in texts), wall_s=wall_s, llm_cpu_s=llm_s, detok_cpu_s=detok_s,
        host_cpu_s=sum(spent.values()), ttfa_p50_s=statistics.median(r.arrivals_s[0] for r in records),
        cpu_s_by_role=by_role,
        windows=tuple(w for r in records for w in chunk_windows(r.durations_s)),
    )  # fmt: skip


def closed_loop(target: str, clients: int, duration_s: float, cfg: SweepConfig, seed: int) -> tuple[int, int]:
    """`clients` threads each sending the sweep's prompts back to back for `duration_s`; (streams, chunks)
    served."""
    prompts, served, chunks, lock = load_prompts(), [0], [0], threading.Lock()
    end_s = time.monotonic() + duration_s

    def client(index: int) -> None:
        rng = random.Random(f"{seed}-{index}")
        with grpc.insecure_channel(target) as channel:
            stub = voxray_pb2_grpc.SpeechStub(channel)
            while time.monotonic() < end_s:
                record = run_one(stub, rng.choice(prompts), rng.randrange(1 << 30), cfg)
                with lock:
                    served[0] += record.is_ok
                    chunks[0] += len(record.durations_s)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=duration_s + cfg.request_timeout_s + 5.0)
    return served[0], chunks[0]


def loaded_steps(server, cfg: SweepConfig, since_s: float, levels: tuple[int, ...] = LOAD_LEVELS,
                 level_s: float = LEVEL_S, rounds: int = LEVEL_ROUNDS,
                 ) -> tuple[dict[int, float], dict | None, tuple[SaturatedLoad, ...]]:  # fmt: skip
    """The LLM replica's serving-loop step by rows from `since_s` (monotonic: the c=1 sets, whose steady
    one-row steps price a lone stream) through the first round of closed-loop levels (larger batches): per
    batch size, the mean of its decode-only cycles (gap + step) in the replica's loop trace
    (`deployments.loop_trace`; the mean, not the median admission paces by, since the streams pay the slow
    tails too; one-row steps in a level fall where streams end and start, its busiest moments; read before
    the later rounds, whose steps would push the c=1 sets' out of the trace's ~3 min); the same cycles'
    spread around their size's mean (`loop_stalls.cycle_spread`); and every level of the `rounds` runs of
    `levels`, its chunks and CPU by group (`SaturatedLoad`, the background still in)."""
    from ray import serve

    from loadtest.loop_stalls import cycle_spread, mean_cycle_ms_by_size

    join_cluster(server)
    try:
        handle = serve.get_deployment_handle("LLMStage", cfg.app_name)
        loads = [_level(server, level, level_s, cfg, 0) for level in levels]
        trace = handle.loop_trace.remote(since_s).result(timeout_s=60)
        loads += [_level(server, level, level_s, cfg, index) for index in range(1, rounds) for level in levels]
        return mean_cycle_ms_by_size(trace), cycle_spread(trace), tuple(loads)
    finally:
        leave_cluster()


def _level(server, clients: int, level_s: float, cfg: SweepConfig, round_index: int) -> SaturatedLoad:
    """One closed-loop level and the CPU each group spent over it (the client: this process, its
    `clients` threads); each round draws its own prompts (round 0 as before the rounds)."""
    root = server.proc.pid
    before, client_before, t0 = cpu_seconds_by_role(root), client_cpu_s(), time.monotonic()
    streams, chunks = closed_loop(server.grpc_target, clients, level_s, cfg, seed=clients + 1000 * round_index)
    wall_s = time.monotonic() - t0
    after = cpu_seconds_by_role(root)
    spent = {role: after.get(role, 0.0) - before.get(role, 0.0) for role in after}
    llm_s, detok_s = spent.pop(LLM_ROLE, 0.0), spent.pop(DETOK_ROLE, 0.0)
    host_s = sum(spent.values()) + client_cpu_s() - client_before
    return SaturatedLoad(clients, wall_s, streams, chunks, host_s, llm_s, detok_s, round=round_index)


def chunk_windows(durations_s: list[float], context: DetokConfig = DetokConfig()) -> list[int]:
    """Each chunk's window frames from the audio it played: its frames, the left context before it (none
    before the stream's start) and the right context after it (none past its end)."""
    kept = [round(d * ORPHEUS_FRAME_RATE_HZ) for d in durations_s]
    total, before, windows = sum(kept), 0, []
    for frames in kept:
        after = total - before - frames
        windows.append(frames + min(context.left_context_frames, before) + min(context.right_context_frames, after))
        before += frames
    return windows


def prompt_sets(count: int) -> tuple[list[str], list[str]]:
    """The shortest and the longest third of the sweep's prompts, `count` of each (cycled)."""
    prompts = sorted(load_prompts(), key=len)
    third = max(1, len(prompts) // 3)
    short, long = prompts[:third], prompts[-third:]
    return [short[i % len(short)] for i in range(count)], [long[i % len(long)] for i in range(count)]


def measure(config, scratch: Path, requests: int, idle_spells: int = IDLE_SPELLS,
            level_rounds: int = LEVEL_ROUNDS) -> HostCost:  # fmt: skip
    """Serve `config` (a `core.config.ServeConfig`) and read it: `idle_spells` idle spells (`spell_counts`),
    the two c=1 sets of `requests` streams each, `level_rounds` rounds of closed-loop levels (`loaded_steps`)."""
    cfg = SweepConfig(app_name=config.app_name, request_timeout_s=60.0)
    short_texts, long_texts = prompt_sets(requests)
    before, between, after = spell_counts(idle_spells)
    with running_server(config, scratch) as server:
        wait_ready(server.grpc_target, config.app_name)
        warm(server.grpc_target, short_texts[:2] + long_texts[:2], cfg)  # both paths
        root = server.proc.pid
        samples = idle_spells_now(root, before)
        since_s = time.monotonic()
        sets = tuple(run_set(name, texts, server.grpc_target, root, cfg)
                     for name, texts in (("short", short_texts), ("long", long_texts)))  # fmt: skip
        samples += idle_spells_now(root, between)
        steps, spread, loads = loaded_steps(server, cfg, since_s, rounds=level_rounds)
        samples += idle_spells_now(root, after, settle_s=SETTLE_S)
    return host_cost_of(sets, loads, steps, tuple(samples), config.llm.num_replicas + config.detok.num_replicas,
                        step_spread=spread)  # fmt: skip


def main(argv: list[str] | None = None) -> HostCost:
    from loadtest.plan_configs import CONFIGS, serve_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/host_cost"))
    parser.add_argument("--requests", type=int, default=12, help="streams in each of the two sets")
    parser.add_argument("--idle-spells", type=int, default=IDLE_SPELLS, help="idle spells the background is read over")
    parser.add_argument("--level-rounds", type=int, default=LEVEL_ROUNDS, help="runs of the closed-loop levels")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cost = measure(serve_config(CONFIGS[0], 19320, 19321), args.out, args.requests, args.idle_spells, args.level_rounds)
    (args.out / "host_cost.json").write_text(json.dumps(asdict(cost), indent=2))
    print(report(cost))
    return cost


if __name__ == "__main__":
    main()

"""What one stream costs the box's CPUs beside the engines, measured on a real `voxray serve` (issue 40's
planner calibration for clusters whose stages share the host's cores).

Serves a configuration (`loadtest.plan_check.serve_config`, one LLM and one detok replica) as a process,
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import psutil

from core.config import DetokConfig
from loadtest.cluster_process import join_cluster, leave_cluster, process_role, running_server, tree_processes
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


@dataclass(frozen=True)
class SetCost:
    """One set of prompts sent one at a time: totals and the CPU seconds of each group of processes."""

    name: str
    streams: int
    chunks: int
    tokens: int
    wall_s: float
    llm_cpu_s: float
    detok_cpu_s: float
    host_cpu_s: float  # every other process of the tree and the client, HostCost.background_cores subtracted
    ttfa_p50_s: float
    cpu_s_by_role: dict[str, float]  # every process group's CPU seconds over the set (client: this process)
    windows: tuple[int, ...]  # frames the detokenizer decoded for each chunk (kept + its context)

    @property
    def chunks_per_stream(self) -> float:
        return self.chunks / self.streams

    @property
    def host_ms_per_stream(self) -> float:
        return 1e3 * self.host_cpu_s / self.streams


@dataclass(frozen=True)
class HostCost:
    """One served calibration's measurements (`measure`); `calibration_host` / `calibration_host_range` fit
    the calibration's sections from them. The fields with defaults may be absent from older host_cost.json files."""

    background_cores: float  # CPU seconds a second the idle server's processes take: the spells' mean
    host_ms_per_stream: float  # a stream's start and end beside the engines (Router, proxy, Ray, client)
    host_ms_per_chunk: float  # each chunk's trip beside the engines
    llm_ms_per_token: float  # the LLM replica's CPU per token at one row (engine step + serving loop)
    detok_ms_per_chunk: float  # the detok replica's CPU per chunk decoded alone
    ttfa_p50_s: float  # c=1, the short set's
    sets: tuple[SetCost, ...]
    detok_windows: tuple[int, ...]  # every chunk's window frames, both sets
    # the LLM replica's serving-loop step (ms) by batch rows under closed-loop load: each size's mean cycle
    loaded_step_ms_by_rows: dict[int, float]
    saturated: SaturatedLoad | None = None  # the last closed-loop level's chunks and host CPU (None: not read)
    levels: tuple[SaturatedLoad, ...] = ()  # every closed-loop level, the last one included
    # idle cores by the served cluster's stage replicas (LLM + detok): the 1x1 here, more where measured
    background_by_replicas: dict[int, float] = field(default_factory=dict)
    # every idle spell's cores, in order (the mean is `background_cores`: the background is a rate, and the
    # periodic upkeep (Ray's metrics, GCS heartbeats) one spell caught the served streams pay too)
    background_samples: tuple[float, ...] = ()


@dataclass(frozen=True)
class SaturatedLoad:
    """One closed-loop level: clients at once, what it served and the host's CPU over it (the background
    subtracted; the LLM and detok replicas' CPU apart)."""

    clients: int
    wall_s: float
    streams: int
    chunks: int
    host_cpu_s: float
    llm_cpu_s: float
    detok_cpu_s: float
    round: int = 0  # which run of the level sequence (0: the first; files from before the repeats: all 0)

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.wall_s


def saturated_host_ms_per_chunk(load: SaturatedLoad, host_ms_per_stream: float) -> float:
    """The host's CPU per chunk at load: its CPU over the level less `host_ms_per_stream` (c=1) a stream
    served, over the chunks served; never below 0."""
    if load.chunks <= 0:
        return 0.0
    return max(0.0, (1e3 * load.host_cpu_s - host_ms_per_stream * load.streams) / load.chunks)


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


def background_split(by_replicas: dict[int, float]) -> tuple[float, float]:
    """(fixed cores, cores per stage replica): the line through the idle background measured at two or more
    cluster sizes (least squares; per replica never below 0); one size: all of it fixed."""
    import numpy as np

    if len(by_replicas) < 2:
        return (next(iter(by_replicas.values()), 0.0), 0.0)
    replicas = np.asarray(list(by_replicas), np.float64)
    cores = np.asarray(list(by_replicas.values()), np.float64)
    slope, intercept = np.polyfit(replicas, cores, 1)
    if slope <= 0:
        return float(cores.mean()), 0.0
    if intercept < 0:  # all of it by replica
        return 0.0, float(cores @ replicas / (replicas @ replicas))
    return float(intercept), float(slope)


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
                 ) -> tuple[dict[int, float], tuple[SaturatedLoad, ...]]:  # fmt: skip
    """The LLM replica's serving-loop step by rows from `since_s` (monotonic: the c=1 sets, whose steady
    one-row steps price a lone stream) through the first round of closed-loop levels (larger batches): per
    batch size, the mean of its decode-only cycles (gap + step) in the replica's loop trace
    (`deployments.loop_trace`; the mean, not the median admission paces by, since the streams pay the slow
    tails too; one-row steps in a level fall where streams end and start, its busiest moments; read before
    the later rounds, whose steps would push the c=1 sets' out of the trace's ~3 min); and every level of
    the `rounds` runs of `levels`, its chunks and CPU by group (`SaturatedLoad`, the background still in)."""
    from ray import serve

    from loadtest.loop_stalls import mean_cycle_ms_by_size

    join_cluster(server)
    try:
        handle = serve.get_deployment_handle("LLMStage", cfg.app_name)
        loads = [_level(server, level, level_s, cfg, 0) for level in levels]
        trace = handle.loop_trace.remote(since_s).result(timeout_s=60)
        loads += [_level(server, level, level_s, cfg, index) for index in range(1, rounds) for level in levels]
        return mean_cycle_ms_by_size(trace), tuple(loads)
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


def less_background(sets: tuple[SetCost, ...], loads: tuple[SaturatedLoad, ...], background: float,
                    ) -> tuple[tuple[SetCost, ...], tuple[SaturatedLoad, ...]]:  # fmt: skip
    """The sets and levels with `background` cores x their wall seconds taken off their host CPU (a
    level's never below 0): one background for all of them, the spells' mean, known once all are read."""
    sets = tuple(replace(s, host_cpu_s=s.host_cpu_s - background * s.wall_s) for s in sets)
    loads = tuple(replace(lv, host_cpu_s=max(0.0, lv.host_cpu_s - background * lv.wall_s)) for lv in loads)
    return sets, loads


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


def split_host_by_round(levels: tuple[SaturatedLoad, ...]) -> dict[int, tuple[float, float]]:
    """Each round's own (ms per stream, ms per chunk) fit (`split_host_at_load` over its levels), by round;
    a round of fewer than two levels has none."""
    rounds = sorted({lv.round for lv in levels})
    fits = {index: split_host_at_load(tuple(lv for lv in levels if lv.round == index)) for index in rounds}
    return {index: fit for index, fit in fits.items() if fit is not None}


def split_host_at_load(levels: tuple[SaturatedLoad, ...]) -> tuple[float, float] | None:
    """(ms per stream, ms per chunk): the least-squares fit of host CPU = a x streams + b x chunks over the
    closed-loop levels (none negative), or None with fewer than two levels. At load, not from the difference
    of the two c=1 sums (which gave 0 ms a stream on 2026-12-06, and the 2x2's host work came out 3-4x short)."""
    import numpy as np

    if len(levels) < 2:
        return None
    a = np.asarray([[lv.streams, lv.chunks] for lv in levels], np.float64)
    b = np.asarray([lv.host_cpu_s for lv in levels], np.float64)
    per_stream_s, per_chunk_s = np.linalg.lstsq(a, b, rcond=None)[0]
    if per_stream_s < 0 or per_chunk_s < 0:  # one term alone, the one that fits better
        fits = [(float(np.sum((b - a[:, k] * c) ** 2)), k, c)
                for k in (0, 1) for c in [max(0.0, float(a[:, k] @ b / max(a[:, k] @ a[:, k], 1e-12)))]]  # fmt: skip
        _, k, c = min(fits)
        per_stream_s, per_chunk_s = (c, 0.0) if k == 0 else (0.0, c)
    return 1e3 * float(per_stream_s), 1e3 * float(per_chunk_s)


def split_host(short: SetCost, long: SetCost) -> tuple[float, float]:
    """(ms per stream, ms per chunk) solving the two sets' host CPU per stream = a + b x chunks per stream;
    with too little spread in chunks, all of it per chunk."""
    spread = long.chunks_per_stream - short.chunks_per_stream
    per_chunk = (long.host_ms_per_stream - short.host_ms_per_stream) / spread if spread > 0.5 else 0.0
    if spread <= 0.5 or per_chunk < 0:
        total = short.host_cpu_s + long.host_cpu_s
        return 0.0, 1e3 * total / (short.chunks + long.chunks)
    per_stream = short.host_ms_per_stream - per_chunk * short.chunks_per_stream
    if per_stream < 0:  # all of it scales with chunks
        return 0.0, 1e3 * (short.host_cpu_s + long.host_cpu_s) / (short.chunks + long.chunks)
    return per_stream, per_chunk


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
        steps, loads = loaded_steps(server, cfg, since_s, rounds=level_rounds)
        samples += idle_spells_now(root, after, settle_s=SETTLE_S)
    return host_cost_of(sets, loads, steps, tuple(samples), config.llm.num_replicas + config.detok.num_replicas)


def host_cost_of(raw_sets: tuple[SetCost, SetCost], raw_loads: tuple[SaturatedLoad, ...], steps: dict[int, float],
                 samples: tuple[float, ...], stage_replicas: int) -> HostCost:  # fmt: skip
    """The measurement from what the served cluster gave (the sets' and levels' host CPU with the background
    still in; `samples`: every idle spell's cores): the background is the spells' mean, taken off them all."""
    background = statistics.fmean(samples)
    sets, loads = less_background(raw_sets, raw_loads, background)
    short, long = sets
    per_stream, per_chunk = split_host(short, long)
    return HostCost(
        background_cores=background, host_ms_per_stream=per_stream, host_ms_per_chunk=per_chunk,
        llm_ms_per_token=1e3 * sum(s.llm_cpu_s for s in sets) / sum(s.tokens for s in sets),
        detok_ms_per_chunk=1e3 * sum(s.detok_cpu_s for s in sets) / sum(s.chunks for s in sets),
        ttfa_p50_s=short.ttfa_p50_s, sets=sets, loaded_step_ms_by_rows=steps,
        detok_windows=short.windows + long.windows, saturated=loads[-1] if loads else None, levels=loads,
        background_by_replicas={stage_replicas: background}, background_samples=samples,
    )  # fmt: skip


def central_split(cost: HostCost) -> tuple[float, float]:
    """(ms per stream, ms per chunk) of the calibration's `host`: fitted together over every closed-loop
    level, all rounds (`split_host_at_load`: many streams and chunks, where the difference of the two c=1
    sums is noise); with one level, a chunk's from the saturated level less the c=1 start cost; with none,
    both from the c=1 sets."""
    at_load = split_host_at_load(cost.levels)
    if at_load is not None:
        return at_load
    if cost.saturated is not None and cost.saturated.chunks > 0:
        return cost.host_ms_per_stream, saturated_host_ms_per_chunk(cost.saturated, cost.host_ms_per_stream)
    return cost.host_ms_per_stream, cost.host_ms_per_chunk


def background_line(cost: HostCost) -> tuple[float, float]:
    """(fixed cores, cores per stage replica) of the idle background (`background_split`)."""
    return background_split(cost.background_by_replicas or {2: cost.background_cores})


def host_section(cores: int, background: tuple[float, float], split: tuple[float, float]) -> dict:
    """One calibration `host` section from (fixed, per-replica) idle cores and (ms per stream, ms per chunk)."""
    (fixed, per_replica), (per_stream, per_chunk) = background, split
    return {
        "cores": cores, "background_cores": round(fixed, 4), "background_cores_per_replica": round(per_replica, 4),
        "cpu_ms_per_stream": round(per_stream, 3), "cpu_ms_per_chunk": round(per_chunk, 3),
    }  # fmt: skip


def calibration_host(cost: HostCost, cores: int) -> dict:
    """The calibration's `host` section from a measurement (see `cluster.planner.calibration.HostCost`): a
    start's and a chunk's CPU as `central_split` fits them, and the idle background (the spells' mean) split
    into a fixed part and a part per stage replica (`background_split`) where more than one cluster size was
    measured idle."""
    return host_section(cores, background_line(cost), central_split(cost))


def typical_chunks_per_stream(cost: HostCost) -> float:
    """Chunks a stream in the c=1 sets (both together): the stream a fit's cost is judged by; without sets,
    the closed-loop levels'; without either, 0."""
    for group in (cost.sets, cost.levels):
        streams = sum(item.streams for item in group)
        if streams > 0:
            return sum(item.chunks for item in group) / streams
    return 0.0


def calibration_host_range(cost: HostCost, cores: int) -> dict | None:
    """The calibration's `host_range`: {"low": the cheapest host measured, "high": the dearest}, each a
    complete `host` section; None where nothing spread (one idle spell and fewer than two rounds' fits).

    - a stream's and a chunk's CPU: of the whole-calibration fit (`central_split`, the `host` section's)
      and each round's own (`split_host_by_round`), "low" takes the one whose typical stream costs the
      host least and "high" the most: cpu_ms_per_stream + cpu_ms_per_chunk x the c=1 sets' chunks a stream
      (`typical_chunks_per_stream`; the two terms alone are ill-conditioned, nearly collinear over the
      levels, their sum at a typical stream is not);
    - the idle background: the `host` section's line (fixed and per replica) scaled by the lowest idle
      spell / the spells' mean for "low", by the highest / the mean for "high" (at the measured 1x1: that
      spell's cores).
    Both choices take the extremes of candidates that include the central one, so `host` lies between the
    two on both counts. A cheaper host leaves the stages more cores: "low" gives the higher capacity."""
    by_round = split_host_by_round(cost.levels)
    samples = cost.background_samples
    if len(by_round) < 2 and len(samples) < 2:
        return None
    chunks = typical_chunks_per_stream(cost)
    fits = [central_split(cost), *by_round.values()]
    cheapest = min(fits, key=lambda fit: fit[0] + fit[1] * chunks)
    dearest = max(fits, key=lambda fit: fit[0] + fit[1] * chunks)
    line, mean = background_line(cost), cost.background_cores
    low_scale, high_scale = (min(samples) / mean, max(samples) / mean) if samples and mean > 0 else (1.0, 1.0)
    return {"low": host_section(cores, _scaled(line, low_scale), cheapest),
            "high": host_section(cores, _scaled(line, high_scale), dearest)}  # fmt: skip


def _scaled(line: tuple[float, float], factor: float) -> tuple[float, float]:
    return line[0] * factor, line[1] * factor


def report(cost: HostCost) -> str:
    lines = ["| set | streams | chunks / stream | LLM ms / token | detok ms / chunk | host ms / stream | TTFA p50 s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in cost.sets:
        per_token, per_chunk = 1e3 * s.llm_cpu_s / s.tokens, 1e3 * s.detok_cpu_s / s.chunks
        lines.append(f"| {s.name} | {s.streams} | {s.chunks_per_stream:.1f} | {per_token:.2f} | {per_chunk:.2f} | "
                     f"{s.host_ms_per_stream:.1f} | {s.ttfa_p50_s:.3f} |")  # fmt: skip
    steps = ", ".join(f"{rows}: {ms:.2f}" for rows, ms in cost.loaded_step_ms_by_rows.items())
    lines.append(f"serving-loop step ms by rows under load: {steps}")
    spells = ", ".join(f"{cores:.3f}" for cores in cost.background_samples)
    lines.append(f"background {cost.background_cores:.3f} cores (idle spells: {spells or '-'}); host "
                 f"{cost.host_ms_per_stream:.1f} ms a stream + {cost.host_ms_per_chunk:.2f} ms a chunk "
                 f"(c=1)")  # fmt: skip
    if cost.saturated is not None:
        sat = cost.saturated
        per_chunk = saturated_host_ms_per_chunk(sat, cost.host_ms_per_stream)
        lines.append(f"saturated ({sat.clients} clients, {sat.wall_s:.1f} s): {sat.streams} streams, "
                     f"{sat.chunks_per_s:.1f} chunks/s, host {sat.host_cpu_s:.2f} CPU s = {per_chunk:.2f} ms a chunk; "
                     f"LLM {sat.llm_cpu_s:.2f}, detok {sat.detok_cpu_s:.2f} CPU s")  # fmt: skip
    at_load = split_host_at_load(cost.levels)
    if at_load is not None:  # what the calibration uses
        levels = ", ".join(f"{lv.clients} (round {lv.round}): {lv.host_cpu_s:.2f} CPU s / {lv.streams} streams / "
                           f"{lv.chunks} chunks" for lv in cost.levels)  # fmt: skip
        lines.append(f"host at load (closed-loop levels {levels}): {at_load[0]:.1f} ms a stream + "
                     f"{at_load[1]:.2f} ms a chunk")  # fmt: skip
    by_round = split_host_by_round(cost.levels)
    if len(by_round) > 1:  # the spread `host_range` spans
        fits = "; ".join(f"round {index}: {a:.1f} ms a stream + {b:.2f} ms a chunk"
                         for index, (a, b) in by_round.items())  # fmt: skip
        lines.append(f"host at load by round: {fits}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> HostCost:
    from loadtest.plan_check import CONFIGS, serve_config

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

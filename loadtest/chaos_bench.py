"""Chaos under load: a real `voxray serve` with the 2-replica CPU config (2 LLM + 2 detok replicas)
plays Poisson arrivals of the sweep's prompts (greedy, seeded and incremental-text streams) while an
LLM or a detok replica is killed every `--kill-every-s` (alternating; `ray.kill`, no restart: Serve
replaces it) and one LLM replica is drained midway (its streams moved out with their KV, then the
replica stopped, as a k8s worker pod leaves); the fault thread starts a long stream a second before each
fault fires (late when the previous fault's recovery ran over), so that each one hits a stream.
Reports per stream: finished or its status, viable, and for greedy / seeded streams whether the audio
equals an undisturbed in-process run; refusals by reason; each fault's time, the streams it hit, their
next chunk and the replacement's start.
Usage: python -m loadtest.chaos_bench --rate 0.2 --duration-s 600 --kill-every-s 60 --out bench_out/chaos/chaos.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from loadtest.chaos_streams import (
    KINDS,
    StreamResult,
    StreamSpec,
    comparable,
    compare_audio,
    plan_streams,
    play,
    reference_audio,
)
from loadtest.cluster_process import (
    join_cluster,
    live_replicas,
    running_server,
    two_replica_config,
    wait_replaced,
)
from protos import voxray_pb2_grpc

# 2 LLM + 2 detok replicas of the CPU config on the 2-core box meet the SLO (p90 TTFA <= 1 s, >= 99%
# viable) at 0.3 req/s and miss it at 0.5 (loadtest.sweep, 40 s per rate, 2026-12-04, shared box): ~60% of 0.3
DEFAULT_RATE_RPS = 0.2
REPLICAS = 2
MAX_INFLIGHT = 48  # arrivals beyond this are recorded as CLIENT_OVERFLOW, not sent
REPLACED_TIMEOUT_S = 90.0  # a replacement not RUNNING by then is reported as not recovered
MOVE_OUT_TIMEOUT_S = 30.0
HIT_MIN_AHEAD_S = 1.0  # a fault waits for a stream with this much audio still to come
FAILOVER_S = 10.0  # refusals of requests sent this long after a kill count as the failover's (the survivors')
HIT_LEAD_S, HIT_MAX_TOKENS = 1.0, 7 * 96  # a target stream starts this long before each fault: 8.2 s of audio


@dataclass(frozen=True)
class Fault:
    at_s: float  # planned, since the bench's start
    action: str  # "kill" or "drain"
    deployment: str  # "LLMStage" or "DetokStage"


@dataclass
class FaultRecord:
    fault: Fault
    waited_s: float = 0.0  # past its time, for a stream to play on the deployment (at most --fault-wait-s)
    done_at_s: float | None = None  # when the replica was killed (drain: when its move-out began)
    replica: str = ""
    streams_playing: int = 0  # streams playing at that moment, on any replica
    hit_streams: list[str] = field(default_factory=list)  # gRPC streams the replica was serving then
    next_chunk_max_s: float | None = None  # until every hit stream had its next chunk
    moved_s: float | None = None  # drain: until the leaving replica held no stream
    streams_left: int | None = None  # drain: streams it still held when the wait ended
    replacement_running_s: float | None = None  # until Serve ran REPLICAS healthy replicas again
    error: str = ""


def fault_schedule(duration_s: float, kill_every_s: float, drain: bool = True) -> list[Fault]:
    """A kill every `kill_every_s` (LLM first, then alternating), and the drain midway between two kills."""
    deployments = ("LLMStage", "DetokStage")
    kills = [Fault(k * kill_every_s, "kill", deployments[(k - 1) % 2])
             for k in range(1, int(duration_s // kill_every_s) + 1) if k * kill_every_s < duration_s]  # fmt: skip
    if not drain:
        return kills
    middle = duration_s / 2
    drain_at = (middle // kill_every_s) * kill_every_s + kill_every_s / 2 if kill_every_s < duration_s else middle
    return sorted([*kills, Fault(min(drain_at, duration_s - 1.0), "drain", "LLMStage")], key=lambda f: f.at_s)


def _served_by(result: StreamResult, deployment: str) -> list[str]:
    return result.llm_replicas if deployment == "LLMStage" else result.detok_replicas


def playing_on(results: list[StreamResult], deployment: str, min_ahead_s: float = 0.0) -> list[StreamResult]:
    """gRPC streams playing now, with `min_ahead_s` of audio still to come, that a replica of `deployment`
    has served (incremental ones do not say)."""
    return [r for r in results
            if r.sent_s and not r.ended_s and _served_by(r, deployment) and r.audio_ahead_s >= min_ahead_s]  # fmt: skip


def wait_for_playing(results: list[StreamResult], deployment: str, wait_s: float) -> float:
    """Seconds waited (at most `wait_s`) until a stream plays on `deployment` with a second or more of
    audio to come: a fault then hits it (not just its last chunk)."""
    start = time.monotonic()
    while not playing_on(results, deployment, HIT_MIN_AHEAD_S) and time.monotonic() - start < wait_s:
        time.sleep(0.05)
    return time.monotonic() - start


def target_streams(faults: list[Fault], seed: int) -> list[StreamSpec]:
    """One long stream for each fault (greedy and seeded in turn), started by the fault thread HIT_LEAD_S
    before the fault fires (`scheduled_s` is the planned time), so that every fault hits at least one stream
    whatever the Poisson arrivals did; compared like the others."""
    samplings = ({"temperature": 0.0}, {"seed": seed * 1000 + 7})
    return [StreamSpec(f"chaos-target-{k}", ("greedy", "seeded")[k % 2], f"Fault number {k} comes now.",
                       {**samplings[k % 2], "max_tokens": HIT_MAX_TOKENS}, max(0.0, fault.at_s - HIT_LEAD_S))
            for k, fault in enumerate(faults)]  # fmt: skip


def busiest_replica(results: list[StreamResult], deployment: str, live: list[str]) -> str:
    """The live replica that served the last chunk of the most streams playing now (else the first)."""
    counts = Counter(_served_by(r, deployment)[-1].rsplit("#", 1)[-1] for r in playing_on(results, deployment))
    ranked = sorted(live, key=lambda replica: (-counts.get(replica, 0), replica))
    return ranked[0]


def playing_at(results: list[StreamResult], t_s: float) -> list[StreamResult]:
    return [r for r in results if r.is_sent and 0 < r.sent_s <= t_s and (not r.ended_s or r.ended_s > t_s)]


def next_chunk_max_s(results: list[StreamResult], t_s: float, req_ids: list[str]) -> float | None:
    """Longest wait from `t_s` to the next chunk over the streams `req_ids` that got one after it."""
    hit = [r for r in results if r.spec.req_id in req_ids]
    waits = [min(c for c in r.chunk_times_s if c > t_s) - t_s for r in hit if max(r.chunk_times_s, default=0) > t_s]
    return max(waits) if waits else None


def inject(fault: Fault, record: FaultRecord, app_name: str, results: list[StreamResult], t0: float,
           wait_s: float) -> None:  # fmt: skip
    """Once a stream plays there (or `wait_s` passed), kill the busiest replica of the fault's deployment,
    or drain one LLM replica then stop it; then wait (bounded) for Serve's replacement."""
    import ray

    from cluster.drain import move_out

    if fault.action == "drain" and wait_replaced(app_name, "LLMStage", set(), REPLICAS, REPLACED_TIMEOUT_S) is None:
        record.error = "the LLM replicas were not all RUNNING before the drain"
    record.waited_s = round(wait_for_playing(results, fault.deployment, wait_s), 3)
    live = live_replicas(app_name, fault.deployment)
    victim = busiest_replica(results, fault.deployment, sorted(live))
    hit = [r for r in playing_on(results, fault.deployment) if _served_by(r, fault.deployment)[-1].endswith(victim)]
    record.replica, record.done_at_s, record.hit_streams = victim, time.monotonic() - t0, [r.spec.req_id for r in hit]
    record.streams_playing = len(playing_at(results, record.done_at_s))
    if fault.action == "drain":
        report = move_out(app_name, [victim], MOVE_OUT_TIMEOUT_S)
        record.moved_s, record.streams_left = round(report.moved_s, 3), report.streams_left
    ray.kill(live[victim], no_restart=True)
    replaced_s = wait_replaced(app_name, fault.deployment, set(live), REPLICAS, REPLACED_TIMEOUT_S)
    record.replacement_running_s = None if replaced_s is None else round(replaced_s, 3)


class Launcher:
    """Starts each stream's `play` on its own thread over one channel, from the sending loop and from the
    fault thread (a fault's target stream); at most MAX_INFLIGHT at once, the rest CLIENT_OVERFLOW."""

    def __init__(self, stub, server, t0: float, timeout_s: float) -> None:
        self.stub, self.server, self.t0, self.timeout_s = stub, server, t0, timeout_s
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def launch(self, result: StreamResult) -> None:
        with self.lock:
            if sum(t.is_alive() for t in self.threads) >= MAX_INFLIGHT:
                result.code = "CLIENT_OVERFLOW"
                return
            args = (result, self.stub, self.server.ws_url, self.server.config.app_name, self.t0, self.timeout_s)
            self.threads.append(threading.Thread(target=play, args=args, daemon=True))
            self.threads[-1].start()

    def join(self, until_s: float) -> None:
        """Wait for every stream started, up to `until_s` on the monotonic clock."""
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=max(1.0, until_s - time.monotonic()))


def run_faults(faults: list[Fault], targets: list[StreamResult | None], records: list[FaultRecord],
               launcher: Launcher, results: list[StreamResult], wait_s: float) -> None:  # fmt: skip
    """The fault thread: each fault at its time (late when the previous one's recovery ran over), its
    target stream (if any) started HIT_LEAD_S before it fires, so a late fault still finds one playing."""
    t0, app_name = launcher.t0, launcher.server.config.app_name
    for fault, target in zip(faults, targets, strict=True):
        lead_s = HIT_LEAD_S if target is not None else 0.0
        time.sleep(max(0.0, t0 + fault.at_s - lead_s - time.monotonic()))
        if target is not None:
            launcher.launch(target)
            time.sleep(lead_s)
        record = FaultRecord(fault)
        records.append(record)
        try:
            inject(fault, record, app_name, results, t0, wait_s)
        except Exception as err:  # reported with the fault; the run goes on
            record.error = f"{type(err).__name__}: {err}"


def fault_thread_bound_s(faults: list[Fault], fault_wait_s: float) -> float:
    """The longest the fault thread can run from the bench's start: the last planned fault, plus, per fault,
    its wait for a stream, a drain's move-out and waits for Serve's replacements (before and after)."""
    last_s = max((f.at_s for f in faults), default=0.0)
    return last_s + len(faults) * (fault_wait_s + HIT_LEAD_S + MOVE_OUT_TIMEOUT_S + 2 * REPLACED_TIMEOUT_S) + 30


def drive(specs: list[StreamSpec], faults: list[Fault], server, timeout_s: float, fault_wait_s: float = 0.0,
          targets: list[StreamSpec] | None = None) -> tuple[list, list]:  # fmt: skip
    """Send every stream of `specs` at its time on its own thread while the fault thread runs and starts
    each fault's stream of `targets` (one per fault, or None: none); wait for all (bounded)."""
    results = [StreamResult(spec) for spec in specs]
    target_results = [StreamResult(spec) for spec in targets] if targets is not None else [None] * len(faults)
    everything = sorted([*results, *(r for r in target_results if r is not None)], key=lambda r: r.spec.scheduled_s)
    records: list[FaultRecord] = []
    t0 = time.monotonic()
    with grpc.insecure_channel(server.grpc_target) as channel:
        launcher = Launcher(voxray_pb2_grpc.SpeechStub(channel), server, t0, timeout_s)
        chaos = threading.Thread(target=run_faults, args=(faults, target_results, records, launcher, everything,
                                                          fault_wait_s))  # fmt: skip
        chaos.start()
        for result in results:
            time.sleep(max(0.0, t0 + result.spec.scheduled_s - time.monotonic()))
            launcher.launch(result)
        chaos.join(timeout=max(1.0, fault_thread_bound_s(faults, fault_wait_s) - (time.monotonic() - t0)))
        last_s = max((r.spec.scheduled_s for r in everything), default=0.0)
        launcher.join(max(t0 + last_s, time.monotonic()) + timeout_s + 10)
    for record in records:
        if record.done_at_s is not None:
            record.next_chunk_max_s = next_chunk_max_s(everything, record.done_at_s, record.hit_streams)
    return everything, records


def summarize(results: list[StreamResult], faults: list[Fault], records: list[FaultRecord]) -> dict:
    sent = [r for r in results if r.is_sent]
    admitted = [r for r in sent if not r.is_refused]
    finished = [r for r in admitted if r.is_finished]
    compared = [r for r in results if r.same_audio is not None]
    num_viable, num_same = sum(r.is_viable for r in finished), sum(bool(r.same_audio) for r in compared)
    refusals = Counter(r.refusal_reason() for r in sent if r.is_refused)
    failed = [{"req_id": r.spec.req_id, "code": r.code, "details": r.details} for r in admitted if not r.is_finished]
    kills = [r.done_at_s for r in records if r.fault.action == "kill" and r.done_at_s is not None]
    in_failover = [r for r in sent if r.is_refused and any(0 <= r.sent_s - at_s <= FAILOVER_S for at_s in kills)]
    return {
        "arrivals": len(results), "sent": len(sent), "client_overflow": len(results) - len(sent),
        "refused": len(sent) - len(admitted), "refusals": dict(refusals),
        "refused_in_failover": len(in_failover),
        "refusals_in_failover": dict(Counter(r.refusal_reason() for r in in_failover)),
        "admitted": len(admitted), "finished": len(finished), "pct_finished": _pct(len(finished), len(admitted)),
        "failed": failed, "viable": num_viable, "pct_viable": _pct(num_viable, len(finished)),
        "compared": len(compared), "same_audio": num_same, "pct_same_audio": _pct(num_same, len(compared)),
        "by_kind": {kind: _kind_row([r for r in results if r.spec.kind == kind]) for kind in KINDS},
        "faults_planned": len(faults),
        "faults_done": sum(r.done_at_s is not None and not r.error for r in records),
    }  # fmt: skip


def _kind_row(results: list[StreamResult]) -> dict:
    sent = [r for r in results if r.is_sent]
    admitted = [r for r in sent if not r.is_refused]
    finished = [r for r in admitted if r.is_finished]
    compared = [r for r in finished if r.same_audio is not None]
    return {"sent": len(sent), "refused": len(sent) - len(admitted), "admitted": len(admitted),
            "finished": len(finished), "viable": sum(r.is_viable for r in finished),
            "compared": len(compared), "same_audio": sum(bool(r.same_audio) for r in compared)}  # fmt: skip


def _pct(part: int, whole: int) -> float | None:
    return round(100.0 * part / whole, 2) if whole else None


def format_report(summary: dict, records: list[FaultRecord]) -> str:
    lines = [f"{'kind':12} {'sent':>5} {'refused':>8} {'admitted':>9} {'finished':>9} {'viable':>7} {'same audio':>11}"]
    for kind, row in summary["by_kind"].items():
        same = f"{row['same_audio']}/{row['compared']}" if kind != "incremental" else "-"
        lines.append(f"{kind:12} {row['sent']:5} {row['refused']:8} {row['admitted']:9} {row['finished']:9} "
                     f"{row['viable']:7} {same:>11}")  # fmt: skip
    lines.append(f"finished {summary['pct_finished']}% of admitted, viable {summary['pct_viable']}% of finished, "
                 f"same audio {summary['pct_same_audio']}% of greedy/seeded; faults {summary['faults_done']}/"
                 f"{summary['faults_planned']}; client overflow {summary['client_overflow']}")  # fmt: skip
    lines += [f"refused x{count}: {reason}" for reason, count in summary["refusals"].items()]
    lines.append(f"refused within {FAILOVER_S:.0f} s after a kill: {summary['refused_in_failover']} "
                 f"{summary['refusals_in_failover']}")  # fmt: skip
    lines += [f"failed: {f['req_id']} {f['code']}: {f['details']}" for f in summary["failed"]]
    lines.append(f"{'fault':18} {'planned s':>9} {'at s':>7} {'replica':>9} {'playing':>7} {'hit':>4} "
                 f"{'next chunk s':>13} {'moved s':>8} {'left':>5} {'replaced s':>11}  error")  # fmt: skip
    for r in records:
        cells = [r.done_at_s, r.next_chunk_max_s, r.moved_s, r.replacement_running_s]
        at, nxt, moved, replaced = ("-" if v is None else f"{v:.2f}" for v in cells)
        left = "-" if r.streams_left is None else str(r.streams_left)
        lines.append(f"{r.fault.action + ' ' + r.fault.deployment:18} {r.fault.at_s:9.1f} {at:>7} {r.replica:>9} "
                     f"{r.streams_playing:7} {len(r.hit_streams):4} {nxt:>13} {moved:>8} {left:>5} {replaced:>11}  "
                     f"{r.error}")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    config = two_replica_config(args.grpc_port, args.http_port)
    faults = fault_schedule(args.duration_s, args.kill_every_s, drain=not args.no_drain)
    specs = plan_streams(args.rate, args.duration_s, args.incremental_share, args.seed)
    targets = None if args.no_target_streams else target_streams(faults, args.seed)
    started_unix_s = time.time()
    with running_server(config, args.out.parent / f"{args.out.stem}-server") as server:
        join_cluster(server)
        live_replicas(config.app_name, "LLMStage")  # the driver's first actor lookups take ~1 s: not at a fault
        results, records = drive(specs, faults, server, args.request_timeout_s, args.fault_wait_s, targets)
    to_compare = comparable(results)  # after the server stopped: the reference has the CPUs to itself
    expected = reference_audio(config.engine, [r.spec for r in to_compare])
    for result in to_compare:
        compare_audio(result, expected[result.spec.req_id])
    summary = summarize(results, faults, records)
    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "started_unix_s": started_unix_s, "loadavg_1m_after": os.getloadavg()[0], "summary": summary,
        "faults": [{**asdict(r.fault), **{k: v for k, v in asdict(r).items() if k != "fault"}} for r in records],
        "streams": [r.to_json() for r in results],
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    print(format_report(summary, records), flush=True)
    print(f"JSON {args.out}; server log {args.out.parent / f'{args.out.stem}-server' / 'serve.log'}")
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=DEFAULT_RATE_RPS, help="Poisson arrivals, req/s (~60%% of capacity)")
    p.add_argument("--duration-s", type=float, default=600.0, help="arrivals stop after this")
    p.add_argument("--kill-every-s", type=float, default=60.0, help="one replica killed this often")
    p.add_argument("--fault-wait-s", type=float, default=15.0, help="a fault waits up to this for a stream to hit")
    p.add_argument("--no-target-streams", action="store_true", help="no long stream started before each fault")
    p.add_argument("--no-drain", action="store_true", help="skip the drain of an LLM replica midway")
    p.add_argument("--incremental-share", type=float, default=0.2, help="share of incremental-text streams")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="deadline of every stream")
    p.add_argument("--grpc-port", type=int, default=19400)
    p.add_argument("--http-port", type=int, default=19401)
    p.add_argument("--out", type=Path, default=Path("bench_out/chaos/chaos.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
    sys.exit(0)

"""Overload benchmark: does admission keep its promise past capacity?

Starts `voxray serve` (`python -m cluster.cli serve`) on the CPU config, on loopback ports of its
own, and sends every request with the SLO as its TTFA deadline. Measures the capacity at SLO
(the sweep's open loop), then Poisson arrivals at 2x and 3x that rate, then a burst of 3x the
streams it admitted at once, sent within 1 s (`--bursts N K`: only K bursts of N streams). Per
phase: share admitted, admitted streams' viability and p90 TTFA, p99 reject latency. With
`--fixed-cap-baseline`, a second server with `admission.policy: fixed_cap` (streams counted
against the cap only) then runs the same capacity sweep, for capacity before / after in one run.
Writes JSON and a markdown table.
Usage: python -m loadtest.overload_bench --out bench_out/overload [--fixed-cap-baseline]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import yaml

from cluster.client import make_request
from loadtest.metrics import (
    RequestRecord,
    capacity_at_slo,
    chunk_lateness_s,
    is_viable,
    percentile,
    summarize,
    ttfa_s,
)
from loadtest.run_all import System, start_ready, stop
from loadtest.serve_voxray import CPU_CONFIG, loadtest_config
from loadtest.sweep import SweepConfig, format_step, is_saturated, server_stamps
from loadtest.workload import arrival_offsets_s, load_prompts
from protos import voxray_pb2_grpc

GRPC_PORT, HTTP_PORT = 19150, 19151
REJECTED = "RESOURCE_EXHAUSTED"


@dataclass
class Sent:
    """One request of a phase: what the client saw, and when it ran (s since the phase began)."""

    record: RequestRecord
    sent_s: float = 0.0
    ended_s: float = 0.0
    sent_unix_s: float = 0.0
    stamps_unix_s: list[tuple[float, ...]] = field(default_factory=list)  # per chunk: the server's hop stamps

    @property
    def is_rejected(self) -> bool:
        return self.record.error == REJECTED


@dataclass
class PhaseResult:
    label: str
    rate_rps: float | None  # None for the burst
    num_sent: int
    num_admitted: int
    pct_admitted: float
    pct_admitted_viable: float | None
    admitted_ttfa_p90_s: float | None
    reject_latency_p99_ms: float | None
    max_admitted_at_once: int
    errors: dict[str, int] = field(default_factory=dict)
    worst_admitted_underrun_s: float = 0.0


def send_one(stub: voxray_pb2_grpc.SpeechStub, text: str, seed: int, cfg: SweepConfig, origin_s: float) -> Sent:
    """One stream with the SLO as its TTFA deadline; never raises for RPC errors."""
    request = make_request(
        text, voice=cfg.voice, sampling={"max_tokens": cfg.max_tokens(text), "seed": seed},
        ttfa_deadline_s=cfg.slo_ttfa_p90_s,
    )  # fmt: skip
    sent = Sent(RequestRecord(text_chars=len(text)), sent_s=time.perf_counter() - origin_s)
    start_s, sent.sent_unix_s = time.perf_counter(), time.time()
    try:
        for chunk in stub.Synthesize(request, metadata=(("application", cfg.app_name),), timeout=cfg.request_timeout_s):
            sent.record.arrivals_s.append(time.perf_counter() - start_s)
            sent.record.durations_s.append(chunk.duration_s)
            sent.stamps_unix_s.append((*server_stamps(chunk.timings), time.time()))
    except grpc.RpcError as err:
        sent.record.is_ok, sent.record.error = False, err.code().name
    sent.ended_s = time.perf_counter() - origin_s
    return sent


def run_phase(stub: voxray_pb2_grpc.SpeechStub, offsets_s: list[float], cfg: SweepConfig, seed: int) -> list[Sent]:
    """Open loop: each request on its own thread at its offset; wait for all (bounded by the timeout)."""
    rng, prompts = random.Random(seed), load_prompts()
    out: list[Sent] = []
    lock = threading.Lock()

    def worker(index: int, text: str) -> None:
        sent = send_one(stub, text, seed * 100_000 + index, cfg, origin_s)
        with lock:
            out.append(sent)

    threads = []
    origin_s = time.perf_counter()
    for index, offset_s in enumerate(offsets_s):
        text = prompts[rng.randrange(len(prompts))]
        time.sleep(max(0.0, origin_s + offset_s - time.perf_counter()))
        thread = threading.Thread(target=worker, args=(index, text), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=cfg.request_timeout_s + 5.0)
    return out


def max_at_once(spans: list[tuple[float, float]]) -> int:
    """Most spans (start, end) open at one time."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    best = current = 0
    for _, delta in edges:
        current += delta
        best = max(best, current)
    return best


def summarize_phase(label: str, rate_rps: float | None, sent: list[Sent]) -> PhaseResult:
    admitted = [s for s in sent if not s.is_rejected]
    ttfas_s = [ttfa_s(s.record.arrivals_s, s.record.durations_s) if s.record.is_ok else None for s in admitted]
    ttfas_s = [float("inf") if t is None else t for t in ttfas_s]  # a failed admitted stream never played
    reject_ms = [(s.ended_s - s.sent_s) * 1000 for s in sent if s.is_rejected]
    summary = summarize(rate_rps or 0.0, [s.record for s in admitted])
    errors = {**summary.errors, **({REJECTED: len(reject_ms)} if reject_ms else {})}
    return PhaseResult(
        label=label, rate_rps=rate_rps, num_sent=len(sent), num_admitted=len(admitted),
        pct_admitted=100.0 * len(admitted) / len(sent) if sent else 0.0,
        pct_admitted_viable=100.0 * sum(is_viable(s.record) for s in admitted) / len(admitted) if admitted else None,
        admitted_ttfa_p90_s=percentile(ttfas_s, 90), reject_latency_p99_ms=percentile(reject_ms, 99),
        max_admitted_at_once=max_at_once([(s.sent_s, s.ended_s) for s in admitted]), errors=errors,
        worst_admitted_underrun_s=summary.worst_underrun_s,
    )  # fmt: skip


def measure_capacity(stub, cfg: SweepConfig) -> tuple[float, list[dict]]:
    """The sweep's rates in increasing order until saturated: capacity at SLO over all requests
    (a rejected request is not viable), and each step's summary."""
    steps, summaries = [], []
    for rate in sorted(cfg.rates_rps):
        rng = random.Random(f"{cfg.seed}-{rate}")
        offsets = arrival_offsets_s(rate, cfg.duration_s, cfg.min_requests, cfg.max_requests, rng)
        sent = run_phase(stub, offsets, cfg, seed=int(rate * 1000))
        summary = summarize(rate, [s.record for s in sent])
        summaries.append(summary)
        steps.append(asdict(summarize_phase(f"sweep {rate:g}", rate, sent)))
        print(format_step("capacity", summary, cfg), flush=True)
        if is_saturated(summary, cfg) or summary.errors.get(REJECTED, 0) > summary.num_requests / 4:
            break
    return capacity_at_slo(summaries, cfg.slo_ttfa_p90_s, cfg.min_pct_viable), steps


def overload(stub, cfg: SweepConfig, capacity_rps: float, duration_s: float) -> list[PhaseResult]:
    """Poisson at 2x and 3x `capacity_rps`, then a burst of 3x the streams admitted at once."""
    phases = []
    for factor in (2, 3):
        rate = factor * capacity_rps
        offsets = arrival_offsets_s(rate, duration_s, cfg.min_requests, 10_000, random.Random(f"overload-{factor}"))
        sent = run_phase(stub, offsets, cfg, seed=factor)
        phases.append(summarize_phase(f"Poisson {factor}x", rate, sent))
        print_phase(phases[-1], sent)
    num_burst = 3 * max(1, max(p.max_admitted_at_once for p in phases))
    offsets = sorted(random.Random("burst").uniform(0.0, 1.0) for _ in range(num_burst))
    sent = run_phase(stub, offsets, cfg, seed=9)
    phases.append(summarize_phase(f"burst of {num_burst} in 1 s", None, sent))
    print_phase(phases[-1], sent)
    return phases


def print_phase(phase: PhaseResult, sent: list[Sent], slow_reject_ms: float = 100.0) -> None:
    """The phase's figures, and for diagnosis the streams that broke its promise: admitted and not
    viable, or refused slower than `slow_reject_ms`."""
    print(phase, flush=True)
    for s in sorted(sent, key=lambda s: s.sent_s):
        slow_reject = s.is_rejected and 1000 * (s.ended_s - s.sent_s) > slow_reject_ms
        if slow_reject or (not s.is_rejected and not is_viable(s.record)):
            print(f"  sent {s.sent_s:5.2f} s  {describe_stream(s)}", flush=True)


def bursts(stub, cfg: SweepConfig, num_streams: int, times: int, gap_s: float) -> list[PhaseResult]:
    """`times` bursts of `num_streams` streams within 1 s, `gap_s` apart (the server idle between):
    what `--bursts` measures alone, with each stream's chunk lateness printed for diagnosis."""
    phases = []
    for index in range(times):
        offsets = sorted(random.Random(f"burst-{index}").uniform(0.0, 1.0) for _ in range(num_streams))
        sent = run_phase(stub, offsets, cfg, seed=9 + index)
        phases.append(summarize_phase(f"burst {index + 1} of {num_streams} in 1 s", None, sent))
        print(phases[-1], flush=True)
        for s in sorted(sent, key=lambda s: s.sent_s):
            print(f"  sent {s.sent_s:5.2f} s  {describe_stream(s)}", flush=True)
        time.sleep(gap_s)
    return phases


def describe_stream(sent: Sent, num_chunks: int = 6) -> str:
    """A stream's outcome: its TTFA and the chunks that came late (index: seconds); when some did,
    its first chunks' path (ms since it was sent: cut, at the detok, decoded, sent by the Router,
    received; and the audio it carried)."""
    record = sent.record
    if not record.is_ok:
        return f"{record.error} after {1000 * (sent.ended_s - sent.sent_s):.0f} ms"
    lateness_s = chunk_lateness_s(record.arrivals_s, record.durations_s)
    late = [(i + 1, round(t, 3)) for i, t in enumerate(lateness_s) if t > 0]
    line = f"TTFA {ttfa_s(record.arrivals_s, record.durations_s):.2f} s, {len(record.arrivals_s)} chunks, late {late}"
    if late:
        for stamps, duration_s in list(zip(sent.stamps_unix_s, record.durations_s, strict=True))[:num_chunks]:
            path_ms = " ".join(f"{1000 * (t - sent.sent_unix_s):5.0f}" for t in stamps)
            line += f"\n      {path_ms}  ({1000 * duration_s:.0f} ms of audio)"
    return line


def serve_command(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config_path)]


def write_config(base: Path, out_dir: Path, policy: str = "predictive") -> Path:
    """The CPU config on this benchmark's loopback ports, as a file for `voxray serve --config`."""
    config = loadtest_config(GRPC_PORT, HTTP_PORT, base)
    admission = config.admission.model_copy(update={"policy": policy})
    config = config.model_copy(update={"admission": admission})
    path = Path(tempfile.mkdtemp(dir=out_dir)) / "serve.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return path


def report(
    capacity_rps: float, sweep: list[dict], phases: list[PhaseResult], cfg: SweepConfig, fixed: tuple | None = None
) -> str:
    """The markdown table; `fixed`: (capacity, sweep) of the fixed-cap admission, measured in the same run."""
    slo = f"(p90 TTFA <= {cfg.slo_ttfa_p90_s:g} s, >= {cfg.min_pct_viable:g}% viable)"
    lines = [f"capacity at SLO {slo}: {capacity_rps:g} req/s"]
    fixed_rows: list[PhaseResult] = []
    if fixed is not None:
        lines.append(f"capacity at SLO with admission.policy fixed_cap, same sweep: {fixed[0]:g} req/s")
        fixed_rows = [PhaseResult(**{**s, "label": f"fixed_cap {s['label']}"}) for s in fixed[1]]
    lines += ["", "| phase | sent | admitted | admitted viable | admitted p90 TTFA | p99 reject latency | errors |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for phase in [PhaseResult(**s) for s in sweep] + phases + fixed_rows:
        viable = "-" if phase.pct_admitted_viable is None else f"{phase.pct_admitted_viable:.0f}%"
        p90 = "-" if phase.admitted_ttfa_p90_s is None else f"{phase.admitted_ttfa_p90_s:.2f} s"
        reject = "-" if phase.reject_latency_p99_ms is None else f"{phase.reject_latency_p99_ms:.0f} ms"
        lines.append(f"| {phase.label} | {phase.num_sent} | {phase.pct_admitted:.0f}% | {viable} | {p90} | {reject} "
                     f"| {phase.errors or ''} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def with_server(config_path: Path, cfg: SweepConfig, out_dir: Path, measure):
    """Start `voxray serve --config config_path`, run `measure(stub)` against it, stop it."""
    system = System("voxray-overload", GRPC_PORT, serve_command(config_path), 300.0)
    proc = start_ready(system, out_dir, cfg.app_name)
    try:
        target = f"127.0.0.1:{GRPC_PORT}"
        with grpc.insecure_channel(target) as channel:
            return measure(voxray_pb2_grpc.SpeechStub(channel))
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1, 1.5, 2, 3])
    p.add_argument("--duration-s", type=float, default=20.0, help="arrivals per sweep rate and per overload phase")
    p.add_argument("--max-requests", type=int, default=40, help="per sweep rate")
    p.add_argument("--config", type=Path, default=CPU_CONFIG)
    p.add_argument("--out", type=Path, default=Path("bench_out/overload"))
    baseline = "then measure capacity at SLO again with admission.policy fixed_cap (a fresh server)"
    p.add_argument("--fixed-cap-baseline", action="store_true", help=baseline)
    p.add_argument("--overload-at", type=float, metavar="RPS",
                   help="skip the capacity sweep: overload phases based on this capacity (req/s)")  # fmt: skip
    p.add_argument(
        "--bursts",
        type=int,
        nargs=2,
        metavar=("STREAMS", "TIMES"),
        help="only bursts: TIMES bursts of STREAMS streams within 1 s, 20 s apart, each stream described",
    )
    args = p.parse_args(argv)
    cfg = SweepConfig(rates_rps=tuple(args.rates), duration_s=args.duration_s, max_requests=args.max_requests)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.bursts:
        num_streams, times = args.bursts
        phases = with_server(write_config(args.config, args.out), cfg, args.out,
                             lambda stub: bursts(stub, cfg, num_streams, times, gap_s=20.0))  # fmt: skip
        return {"phases": [asdict(phase) for phase in phases]}

    def measure_and_overload(stub) -> tuple[float, list[dict], float, list[PhaseResult]]:
        if args.overload_at:
            return args.overload_at, [], args.overload_at, overload(stub, cfg, args.overload_at, args.duration_s)
        capacity_rps, sweep = measure_capacity(stub, cfg)
        base_rps = capacity_rps or min(cfg.rates_rps)  # nothing met the SLO: overload the lowest rate
        return capacity_rps, sweep, base_rps, overload(stub, cfg, base_rps, args.duration_s)

    capacity_rps, sweep, base_rps, phases = with_server(write_config(args.config, args.out), cfg, args.out,
                                                        measure_and_overload)  # fmt: skip
    fixed = None
    if args.fixed_cap_baseline:
        fixed_config = write_config(args.config, args.out, policy="fixed_cap")
        fixed = with_server(fixed_config, cfg, args.out, lambda stub: measure_capacity(stub, cfg))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"config": asdict(cfg), "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "capacity_rps": capacity_rps, "overload_base_rps": base_rps, "sweep": sweep,
              "phases": [asdict(phase) for phase in phases],
              "fixed_cap": None if fixed is None else {"capacity_rps": fixed[0], "sweep": fixed[1]}}  # fmt: skip
    (args.out / "overload_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    markdown = report(capacity_rps, sweep, phases, cfg, fixed)
    (args.out / "overload_bench.md").write_text(markdown)
    print(markdown)
    return result


if __name__ == "__main__":
    main()

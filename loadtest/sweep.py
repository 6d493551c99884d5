"""Open-loop rate sweep against a `voxray.Speech` gRPC endpoint (VoxRay or a baseline server).

For each rate: Poisson (or bursty Gamma) arrivals of bundled prompts, one thread per stream,
DESIGN §1 metrics per rate, capacity at SLO. Bounded: arrivals per rate, in-flight streams,
and wall time (every call carries a deadline). Writes JSON; `loadtest.plots` draws it.
Usage: python -m loadtest.sweep --target 127.0.0.1:9000 --rates 0.25 0.5 1 --out-dir out/
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from cluster.client import make_request
from loadtest.metrics import RateSummary, RequestRecord, capacity_at_slo, chunk_hops_s, meets_slo, summarize
from loadtest.workload import arrival_offsets_s, check_target, load_prompts, max_tokens_for
from protos import voxray_pb2, voxray_pb2_grpc


@dataclass(frozen=True)
class SweepConfig:
    rates_rps: tuple[float, ...] = (0.25, 0.5, 1.0)
    duration_s: float = 30.0  # arrivals per rate stop after this (once min_requests were sent)
    min_requests: int = 8
    max_requests: int = 60
    max_inflight: int = 48  # arrivals beyond this are recorded as client overflow, not sent
    request_timeout_s: float = 60.0
    process: str = "poisson"
    gamma_cv: float = 2.0
    slo_ttfa_p90_s: float = 1.0
    min_pct_viable: float = 99.0
    stop_p90_ttfa_s: float = 10.0  # saturated: stop the sweep after a rate whose p90 TTFA exceeds this
    max_tokens_cap: int | None = None  # shorter requests (smoke tests); None = follow each prompt's length
    seed: int = 0
    app_name: str = "voxray"
    voice: str = "tara"
    # the served family's audio rate, so each prompt asks for the same seconds of audio (None = Orpheus)
    frame_rate_hz: float | None = None
    steps_per_frame: float = 7.0

    def max_tokens(self, text: str) -> int:
        tokens = max_tokens_for(text, self.frame_rate_hz, self.steps_per_frame)
        return tokens if self.max_tokens_cap is None else min(self.max_tokens_cap, tokens)


@dataclass
class SweepResult:
    label: str
    target: str
    config: dict
    steps: list[dict] = field(default_factory=list)
    capacity_rps: float = 0.0
    wall_s: float = 0.0


def run_one(stub: voxray_pb2_grpc.SpeechStub, text: str, seed: int, cfg: SweepConfig) -> RequestRecord:
    """Send one request and record chunk arrivals; never raises for RPC errors."""
    record = RequestRecord(text_chars=len(text))
    sampling = {"max_tokens": cfg.max_tokens(text), "seed": seed}
    request = make_request(text, voice=cfg.voice, sampling=sampling)
    start = time.perf_counter()
    try:
        for chunk in stub.Synthesize(request, metadata=(("application", cfg.app_name),), timeout=cfg.request_timeout_s):
            record.arrivals_s.append(time.perf_counter() - start)
            record.durations_s.append(chunk.duration_s)
            hops = chunk_hops_s(server_stamps(chunk.timings), time.time())
            if hops is not None:
                record.hops_s.append(hops)
    except grpc.RpcError as err:
        record.is_ok, record.error = False, err.code().name
    return record


def server_stamps(timings: voxray_pb2.ServerTimings) -> tuple[float, float, float, float]:
    return (timings.chunk_ready_unix_s, timings.detok_received_unix_s, timings.audio_ready_unix_s,
            timings.router_sent_unix_s)  # fmt: skip


def run_rate(
    stub: voxray_pb2_grpc.SpeechStub, rate_rps: float, prompts: list[str], cfg: SweepConfig
) -> list[RequestRecord]:
    """Open loop: dispatch each arrival on its own thread at its time; wait for all (bounded by timeouts)."""
    rng = random.Random(f"{cfg.seed}-{rate_rps}")
    offsets = arrival_offsets_s(
        rate_rps, cfg.duration_s, cfg.min_requests, cfg.max_requests, rng, cfg.process, cfg.gamma_cv
    )
    records: list[RequestRecord] = []
    threads: list[threading.Thread] = []
    lock = threading.Lock()
    start = time.perf_counter()
    for i, offset in enumerate(offsets):
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        text = prompts[rng.randrange(len(prompts))]
        if sum(t.is_alive() for t in threads) >= cfg.max_inflight:
            records.append(RequestRecord(is_ok=False, error="CLIENT_OVERFLOW", scheduled_at_s=offset))
            continue
        lag = time.perf_counter() - start - offset
        thread = threading.Thread(
            target=_worker, args=(stub, text, cfg.seed * 100_000 + i, cfg, offset, lag, records, lock)
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=cfg.request_timeout_s + 5.0)
    return records


def _worker(
    stub: voxray_pb2_grpc.SpeechStub, text: str, seed: int, cfg: SweepConfig, offset: float, lag: float,
    out: list[RequestRecord], lock: threading.Lock,
) -> None:  # fmt: skip
    record = run_one(stub, text, seed, cfg)
    record.scheduled_at_s, record.send_lag_s = offset, lag
    with lock:
        out.append(record)


def wait_ready(target: str, app_name: str, timeout_s: float = 180.0, voice: str = "tara") -> None:
    """Block until one short request streams audio (models warm, routes up); raise on timeout."""
    deadline = time.monotonic() + timeout_s
    cfg = SweepConfig(app_name=app_name, request_timeout_s=30.0, voice=voice)
    last = ""
    while time.monotonic() < deadline:
        with grpc.insecure_channel(target) as channel:
            record = run_one(voxray_pb2_grpc.SpeechStub(channel), "warm up", 0, cfg)
        if record.is_ok and record.durations_s:
            return
        last = record.error
        time.sleep(1.0)
    raise TimeoutError(f"{target} not ready after {timeout_s:.0f} s (last error: {last})")


def run_sweep(target: str, cfg: SweepConfig, label: str, allow_remote: bool = False) -> SweepResult:
    """All rates in increasing order, stopping after the first saturated rate (see `is_saturated`)."""
    check_target(target, allow_remote)
    prompts = load_prompts()
    result = SweepResult(label=label, target=target, config=asdict(cfg))
    summaries: list[RateSummary] = []
    start = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        for rate in sorted(cfg.rates_rps):
            step_start = time.monotonic()
            records = run_rate(stub, rate, prompts, cfg)
            summary = summarize(rate, records)
            summaries.append(summary)
            result.steps.append({"summary": summary.to_json(), "requests": [asdict(r) for r in records],
                                 "wall_s": round(time.monotonic() - step_start, 2)})  # fmt: skip
            print(format_step(label, summary, cfg), flush=True)
            if is_saturated(summary, cfg):
                break
    result.capacity_rps = capacity_at_slo(summaries, cfg.slo_ttfa_p90_s, cfg.min_pct_viable)
    result.wall_s = round(time.monotonic() - start, 1)
    return result


def is_saturated(summary: RateSummary, cfg: SweepConfig) -> bool:
    """Higher rates would only queue more: p90 TTFA past the ceiling, or most requests failed."""
    p90 = summary.ttfa_p90_s
    return p90 is None or p90 > cfg.stop_p90_ttfa_s or summary.num_ok < summary.num_requests / 2


def format_step(label: str, s: RateSummary, cfg: SweepConfig) -> str:
    p90 = "inf" if s.ttfa_p90_s is None or s.ttfa_p90_s == float("inf") else f"{s.ttfa_p90_s * 1000:.0f} ms"
    mark = "meets SLO" if meets_slo(s, cfg.slo_ttfa_p90_s, cfg.min_pct_viable) else "misses SLO"
    return (
        f"[{label}] {s.rate_rps:g} req/s: n={s.num_requests} ok={s.num_ok} p90 TTFA {p90} "
        f"viable {s.pct_viable:.0f}% on-time chunks {s.pct_chunks_on_time:.0f}% worst underrun "
        f"{s.worst_underrun_s:.2f} s stream speed {s.stream_speed_p50_x or 0:.2f}x errors {s.errors} -> {mark}"
    )


def write_result(result: SweepResult, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result.label}.json"
    path.write_text(json.dumps(asdict(result), indent=1, allow_nan=False) + "\n")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="127.0.0.1:9000", help="gRPC host:port (loopback unless --allow-remote)")
    p.add_argument("--app", default="voxray", help="Serve application name (gRPC metadata)")
    p.add_argument("--label", default="voxray", help="name of the JSON file and of the plot series")
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="request rates, req/s")
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-requests", type=int, default=60)
    p.add_argument("--process", choices=["poisson", "gamma"], default="poisson")
    p.add_argument("--gamma-cv", type=float, default=2.0, help="coefficient of variation of gamma gaps")
    p.add_argument("--slo-ttfa-p90-s", type=float, default=1.0)
    p.add_argument("--stop-p90-ttfa-s", type=float, default=10.0, help="stop after a rate with a worse p90 TTFA")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--out-dir", type=Path, default=Path("bench_out/sweep"))
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--model", default=None, help="served model name: its default voice and frame rate (default: Orpheus)"
    )
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    family: dict = {}
    if args.model is not None:
        from llm_stage.registry import get_entry

        entry = get_entry(args.model)
        family = {"voice": entry.default_voice or "", "frame_rate_hz": entry.family.frame_rate_hz,
                  "steps_per_frame": entry.family.lm.steps_per_frame}  # fmt: skip
    return SweepConfig(
        rates_rps=tuple(args.rates), duration_s=args.duration_s, min_requests=args.min_requests,
        max_requests=args.max_requests, process=args.process, gamma_cv=args.gamma_cv,
        slo_ttfa_p90_s=args.slo_ttfa_p90_s, stop_p90_ttfa_s=args.stop_p90_ttfa_s,
        request_timeout_s=args.request_timeout_s, app_name=args.app, **family,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> SweepResult:
    args = parse_args(argv)
    result = run_sweep(args.target, config_from_args(args), args.label, args.allow_remote)
    path = write_result(result, args.out_dir)
    if not args.no_plots:
        from loadtest.plots import plot_all

        plot_all([result.__dict__], args.out_dir, args.slo_ttfa_p90_s)
    print(f"[{args.label}] capacity at SLO (p90 TTFA <= {args.slo_ttfa_p90_s:g} s, >= 99% viable): "
          f"{result.capacity_rps:g} req/s; JSON {path}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()

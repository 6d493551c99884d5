"""The Serve cluster's half of the GPU load sweep: open-loop Poisson arrivals of 7.2 s streams over gRPC against a
running `voxray serve`, with the arrivals, texts, seeds and max_tokens of the in-process half
(loadtest.gpu_bench_pipeline), each request carrying the TTFA deadline admission judges it by. One asyncio loop
(grpc.aio) holds every stream, so the client's own scheduling stays out of the TTFA it measures. c=1 TTFA first;
per rate each stream's send, end, chunk arrivals and status -> loadtest.gpu.sweep_compare.cluster_row. One JSON;
loadtest/gpu/sweep_run.sh runs it against the cluster it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import grpc

from cluster.client import make_request
from llm_stage.models.orpheus import TOKENS_PER_FRAME
from loadtest.gpu.sweep_compare import CAPPED, RateRow, StreamResult, cluster_row, is_saturated
from loadtest.gpu_bench_pipeline import FRAME_S, TEXTS, poisson_arrivals_s
from loadtest.metrics import chunk_hops_s, hop_breakdown
from loadtest.sweep import server_stamps, wait_ready
from loadtest.workload import check_target
from protos import voxray_pb2_grpc

NUM_LONE = 4  # as loadtest.gpu.inprocess_sweep


def request_for(index: int, args: argparse.Namespace):
    sampling = {"max_tokens": args.max_tokens, "seed": index}  # the in-process player's seed and length
    return make_request(TEXTS[index % len(TEXTS)], voice=args.voice, sampling=sampling,
                        ttfa_deadline_s=args.ttfa_deadline_s)  # fmt: skip


async def play_stream(stub, request, result: StreamResult, origin_s: float, args: argparse.Namespace) -> None:
    """Read one stream into `result` until it ends; a cancellation (the rate's cap) marks it CAPPED."""
    sent_s = time.perf_counter()
    result.sent_s = sent_s - origin_s
    call = stub.Synthesize(request, metadata=(("application", args.app),), timeout=args.request_timeout_s)
    try:
        async for chunk in call:
            result.arrivals_s.append(time.perf_counter() - sent_s)
            result.durations_s.append(chunk.duration_s)
            hops = chunk_hops_s(server_stamps(chunk.timings), time.time())
            if hops is not None:
                result.hops_s.append(hops)
    except grpc.aio.AioRpcError as err:
        result.code = err.code().name
    except asyncio.CancelledError:
        call.cancel()
        result.code = CAPPED
    finally:
        result.ended_s = time.perf_counter() - origin_s


async def play_rate(
    stubs: list, rate_rps: float, args: argparse.Namespace, cap_s: float
) -> tuple[list[StreamResult], float]:
    """Each arrival sent at its time, over the stubs in turn; streams still open after `cap_s` are cancelled
    (CAPPED, not viable)."""
    offsets = poisson_arrivals_s(rate_rps, max(2, round(rate_rps * args.arrival_s)))
    results = [StreamResult(sent_s=offset) for offset in offsets]
    origin_s = time.perf_counter()
    tasks = []
    for index, offset in enumerate(offsets):
        await asyncio.sleep(max(0.0, origin_s + offset - time.perf_counter()))
        if time.perf_counter() - origin_s >= cap_s:
            results[index].code, results[index].ended_s = CAPPED, offset  # never sent: the cap came first
            continue
        stub, request = stubs[index % len(stubs)], request_for(index, args)
        tasks.append(asyncio.create_task(play_stream(stub, request, results[index], origin_s, args)))
    pending: set[asyncio.Task] = set()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, origin_s + cap_s - time.perf_counter()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return results, time.perf_counter() - origin_s


async def lone_ttfa_s(stub, index: int, args: argparse.Namespace) -> float | None:
    """One request alone, cancelled at its first audio."""
    start = time.perf_counter()
    call = stub.Synthesize(request_for(index, args), metadata=(("application", args.app),), timeout=60.0)
    try:
        async for chunk in call:
            if chunk.duration_s > 0:
                return round(time.perf_counter() - start, 4)
    except grpc.aio.AioRpcError:
        return None
    finally:
        call.cancel()
    return None


async def sweep(args: argparse.Namespace, end_s: float, out: dict) -> None:
    """`--channels` connections, then c=1 TTFA and the rates (play_rates) into `out`."""
    out["rows"], out["streams"], out["hops_ms"] = [], {}, {}
    # Connections of their own (not one shared subchannel), as many clients would open: the Router replicas share
    # the gRPC port (SO_REUSEPORT), so the kernel spreads connections, not streams, over them.
    channels = [grpc.aio.insecure_channel(args.target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(args.channels)]  # fmt: skip
    stubs = [voxray_pb2_grpc.SpeechStub(channel) for channel in channels]
    try:
        await play_rates(stubs, args, end_s, out)
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


async def play_rates(stubs: list, args: argparse.Namespace, end_s: float, out: dict) -> None:
    """c=1 TTFA, then the rates in increasing order into `out` (saved after each), as the in-process half runs them."""
    rows: list[RateRow] = out["rows"]
    lone = [await lone_ttfa_s(stubs[0], 1_000_000 + i, args) for i in range(NUM_LONE)]
    warm = [t for t in lone[1:] if t is not None]
    out["c1_ttfa_s"], out["c1_warm_ttfa_s"] = lone, round(statistics.median(warm), 4) if warm else None
    rates, saturated = sorted(args.rates), False
    for index, rate in enumerate(rates):
        cap_s = min(args.rate_cap_s, (end_s - time.monotonic()) / (len(rates) - index))
        if saturated or cap_s < args.arrival_s:
            rows.append(RateRow(rate_rps=rate, skipped="saturated below" if saturated else "out of time"))
            continue
        streams, wall_s = await play_rate(stubs, rate, args, cap_s)
        rows.append(cluster_row(rate, streams, wall_s))
        out["streams"][f"{rate:g}"] = [[round(s.sent_s, 3), round(s.ended_s, 3), s.code] for s in streams]
        out["hops_ms"][f"{rate:g}"] = hop_breakdown([s.record() for s in streams])  # where a chunk's time went
        print(f"[cluster] {rate:g} req/s: {asdict(rows[-1])}", flush=True)
        saturated = is_saturated(rows[-1], args.stop_p90_ttfa_s)
        save(out, args.out)
        await asyncio.sleep(args.settle_s)  # streams cancelled at the cap leave the replicas before the next rate


def save(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(out, indent=1, default=lambda o: asdict(o) if isinstance(o, RateRow) else str(o)))
    scratch.replace(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="127.0.0.1:19500", help="gRPC host:port (loopback)")
    p.add_argument("--app", default="voxray")
    p.add_argument("--voice", default="tara", help="Orpheus' default voice (the in-process half sends none: the same)")
    p.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8, 16, 24], help="req/s")
    p.add_argument("--arrival-s", type=float, default=8.0)
    p.add_argument("--rate-cap-s", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=588)
    p.add_argument("--ttfa-deadline-s", type=float, default=0.5, help="each request's TTFA deadline (0 = server's)")
    p.add_argument("--stop-p90-ttfa-s", type=float, default=5.0)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--settle-s", type=float, default=1.0)
    p.add_argument("--channels", type=int, default=8, help="gRPC connections the streams take in turn")
    p.add_argument("--ready-timeout-s", type=float, default=60.0, help="for the first stream to play")
    p.add_argument("--budget-s", type=float, default=180.0, help="the whole run, warm-up included")
    p.add_argument("--out", type=Path, required=True, help="the JSON written")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    check_target(args.target, allow_remote=False)
    start = time.monotonic()
    out = {"target": args.target, "rates_rps": sorted(args.rates), "arrival_s": args.arrival_s,
           "max_tokens": args.max_tokens, "audio_s_per_stream": round(args.max_tokens / TOKENS_PER_FRAME * FRAME_S, 2),
           "ttfa_deadline_s": args.ttfa_deadline_s, "rows": []}  # fmt: skip
    wait_ready(args.target, args.app, timeout_s=args.ready_timeout_s, voice=args.voice)
    out["warm_s"] = round(time.monotonic() - start, 1)
    asyncio.run(sweep(args, start + args.budget_s, out))
    out["wall_s"] = round(time.monotonic() - start, 1)
    save(out, args.out)
    print(f"[cluster] c=1 TTFA {out.get('c1_warm_ttfa_s')} s; {out['wall_s']} s; {args.out}", flush=True)
    return out


if __name__ == "__main__":
    main()

"""Milliseconds and bytes per stage-to-stage tensor transfer: RDT over gloo vs the object store
(and NCCL when CUDA is present), for one request's KV at 1 / 64 / 512 positions and for voice
conditioning tensors. Two `TensorEndpoint` actors on a local Ray, the same tensors, one run.
With `--moves`, the whole path of a moved stream's KV instead, from the receiving replica's ask
to the rows in its hands: read from the sender's object store vs delivered by the `KVCourier`
(its source endpoint reads the parcel, RDT gloo to its sink, the receiver reads the sink).
Usage: python -m loadtest.transport_bench --repeats 20 [--kv-layout 28 8 128 --dtype bfloat16] [--moves]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray
import torch

from deployments.transport import TensorEndpoint, TensorTransport, TransportKind, num_bytes

# orpheus-tiny (the CPU preset): 2 layers, 2 KV heads, head dim 64, fp32
DEFAULT_KV_LAYOUT = (2, 2, 64)


def payloads(kv_layout: tuple[int, int, int], dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    layers, kv_heads, head_dim = kv_layout
    out = {
        f"KV, {n} positions": {
            "keys": torch.randn(layers, kv_heads, n, head_dim).to(dtype),
            "values": torch.randn(layers, kv_heads, n, head_dim).to(dtype),
        }
        for n in (1, 64, 512)
    }
    out["speaker x-vector (192)"] = {"xvector": torch.randn(192)}
    out["prompt mel (80 x 500) + tokens (250)"] = {
        "mel": torch.randn(80, 500),
        "tokens": torch.randint(0, 6561, (250,)),
    }
    return out


def time_kind(kind: TransportKind, tensors: dict[str, dict[str, torch.Tensor]], repeats: int, device: str) -> dict:
    src, dst = TensorEndpoint.remote("src"), TensorEndpoint.remote("dst")
    transport = TensorTransport([src, dst], kind)
    rows = {}
    try:
        for label, payload in tensors.items():
            ray.get(src.hold.remote(label, {k: v.to(device) for k, v in payload.items()}))
            transport.move(label, src, dst)  # warm: first transfer sets up buffers
            times = [transport.move(label, src, dst).seconds for _ in range(repeats)]
            rows[label] = {"bytes": num_bytes(payload), "p50_ms": 1000 * statistics.median(times),
                           "min_ms": 1000 * min(times)}  # fmt: skip
    finally:
        transport.close()
        for endpoint in (src, dst):
            ray.kill(endpoint)
    return rows


@ray.remote(num_cpus=0)
class _Sender:
    """The replica a stream leaves: owns its parcel (ray.put here), as `KVMoves.parcel` does."""

    def __init__(self) -> None:
        self.kept: list = []

    def parcel(self, payload: dict[str, torch.Tensor]) -> list:
        self.kept.append(ray.put(payload))
        return [self.kept[-1]]  # in a list: the ref itself, not its value


@ray.remote(num_cpus=0)
class _Receiver:
    """The replica that continues it: seconds from its ask to the rows in hand, either way."""

    def from_object_store(self, parcel: list) -> float:
        start = time.perf_counter()
        ray.get(parcel[0])
        return time.perf_counter() - start

    def over_courier(self, courier, parcel: list, key: str) -> float:
        node = ray.get_runtime_context().get_node_id()
        start = time.perf_counter()
        delivered = ray.get(courier.deliver.remote(parcel, key, node, node))
        ray.get(delivered.sink.get.remote(key))
        elapsed = time.perf_counter() - start
        ray.get(delivered.sink.drop.remote(key))
        return elapsed


def time_moves(tensors: dict[str, dict[str, torch.Tensor]], repeats: int) -> dict[str, dict]:
    """Per KV payload: p50 ms of a moved stream's rows read from the object store vs over the courier."""
    from deployments.kv_courier import COURIER_CONCURRENCY, KVCourierActor

    sender, receiver = _Sender.remote(), _Receiver.remote()
    courier = KVCourierActor.options(max_concurrency=COURIER_CONCURRENCY).remote("gloo")
    node = ray.get_runtime_context().get_node_id()
    ray.get(courier.prepare.remote(node, node))  # the pair forms once, at replica start
    results: dict[str, dict] = {"object_store": {}, "courier (gloo)": {}}
    try:
        for label, payload in tensors.items():
            if not label.startswith("KV"):
                continue
            parcels = [ray.get(sender.parcel.remote(payload)) for _ in range(repeats + 1)]
            ways = {
                "object_store": lambda p: receiver.from_object_store.remote(p),
                "courier (gloo)": lambda p, n=label: receiver.over_courier.remote(courier, p, f"{n}-{id(p)}"),
            }
            for way, read in ways.items():
                times = [ray.get(read(parcel)) for parcel in parcels][1:]  # the first warms the path
                results[way][label] = {"bytes": num_bytes(payload), "p50_ms": 1000 * statistics.median(times),
                                       "min_ms": 1000 * min(times)}  # fmt: skip
    finally:
        for actor in (sender, receiver, courier):
            ray.kill(actor)
    return results


def table(results: dict[str, dict]) -> str:
    kinds = list(results)
    first = results[kinds[0]]
    lines = ["| tensor | bytes | " + " | ".join(f"{k} p50 ms" for k in kinds) + " |", "|---" * (2 + len(kinds)) + "|"]
    for label, row in first.items():
        cells = [f"{results[k][label]['p50_ms']:.2f}" for k in kinds]
        lines.append(f"| {label} | {row['bytes']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def time_kinds(tensors: dict[str, dict[str, torch.Tensor]], repeats: int) -> dict[str, dict]:
    kinds = [TransportKind.OBJECT_STORE, TransportKind.GLOO]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        kinds.append(TransportKind.NCCL)
    results = {}
    for kind in kinds:
        device = "cuda" if kind is TransportKind.NCCL else "cpu"
        results[kind.value] = time_kind(kind, tensors, repeats, device)
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kv-layout", type=int, nargs=3, default=list(DEFAULT_KV_LAYOUT), help="layers kv_heads head_dim")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--moves", action="store_true", help="a moved stream's KV end to end: object store vs courier")
    args = p.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    tensors = payloads(tuple(args.kv_layout), getattr(torch, args.dtype))
    results = time_moves(tensors, args.repeats) if args.moves else time_kinds(tensors, args.repeats)
    ray.shutdown()
    print(table(results))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()

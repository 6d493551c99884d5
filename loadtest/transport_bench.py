"""Milliseconds and bytes per stage-to-stage tensor transfer: RDT over gloo vs the object store
(and NCCL when CUDA is present), for one request's KV at 1 / 64 / 512 positions and for voice
conditioning tensors. Two `TensorEndpoint` actors on a local Ray, the same tensors, one run.
Usage: python -m loadtest.transport_bench --repeats 20 [--kv-layout 28 8 128 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def table(results: dict[str, dict]) -> str:
    kinds = list(results)
    first = results[kinds[0]]
    lines = ["| tensor | bytes | " + " | ".join(f"{k} p50 ms" for k in kinds) + " |", "|---" * (2 + len(kinds)) + "|"]
    for label, row in first.items():
        cells = [f"{results[k][label]['p50_ms']:.2f}" for k in kinds]
        lines.append(f"| {label} | {row['bytes']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kv-layout", type=int, nargs=3, default=list(DEFAULT_KV_LAYOUT), help="layers kv_heads head_dim")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    tensors = payloads(tuple(args.kv_layout), getattr(torch, args.dtype))
    kinds = [TransportKind.OBJECT_STORE, TransportKind.GLOO]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        kinds.append(TransportKind.NCCL)
    results = {}
    for kind in kinds:
        device = "cuda" if kind is TransportKind.NCCL else "cpu"
        results[kind.value] = time_kind(kind, tensors, args.repeats, device)
    ray.shutdown()
    print(table(results))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()

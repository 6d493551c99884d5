"""What crosses between devices in the disaggregated GPU config, priced on paper against link bandwidths.

No second GPU was at hand (issue 37 item 7: NCCL needs two devices; the stage transport's NCCL
path, the KV courier across GPUs and `deployments/configs/gpu.yaml` stay tested on CPU with gloo).
This estimate takes what a stream moves from the config (its chunk schedule, admission cap) and the
one-GPU bench's JSON (KV bytes per token, the decode step, SNAC's decode per chunk batch, all
measured on an H200), builds the real messages to size them (a pickled `TokenChunk` as Ray ships
it, an `AudioChunk`'s PCM16), and prices each against links whose bandwidths and latencies are
stated assumptions (80% of the nominal one-direction bandwidth, typical NCCL / RPC floors), plus
Ray's object store within a node as measured on the CPU box (`loadtest.transport_bench`).

    .venv/bin/python -m loadtest.two_gpu_estimate --rates 20 40 --out bench_out/two_gpu_estimate.json
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path

from core.config import DetokConfig, load_serve_config
from core.messages import AudioChunk, TokenChunk

ROOT = Path(__file__).resolve().parents[1]
GPU_CONFIG = ROOT / "deployments" / "configs" / "gpu.yaml"
GPU_BENCH_JSON = ROOT / "docs" / "experiments" / "gpu-2026-12-04" / "gpu_bench_run2.json"
SNAC_SAMPLES_PER_FRAME = 2048  # 24 kHz, 85.3 ms per frame, 7 codes per frame (Orpheus)
SNAC_SAMPLE_RATE_HZ = 24_000
CODES_PER_FRAME = 7
STREAM_AUDIO_S = 7.2  # the sweeps' stream length
PROMPT_TOKENS = 40  # a sweep prompt with Orpheus' voice prefix and special tokens (approximate)
EFFICIENCY = 0.8  # share of a link's nominal bandwidth a transfer is assumed to get


@dataclass(frozen=True)
class Link:
    name: str
    nominal_gb_s: float  # one direction, 1e9 B/s
    latency_us: float  # per transfer, before the first byte (assumed floor)
    measured: bool = False  # True: both figures measured (not nominal x EFFICIENCY)

    @property
    def effective_b_s(self) -> float:
        return self.nominal_gb_s * 1e9 * (1.0 if self.measured else EFFICIENCY)

    def transfer_ms(self, num_bytes: int) -> float:
        return self.latency_us / 1e3 + 1e3 * num_bytes / self.effective_b_s


LINKS = [
    Link("NVLink 4 (H100 / H200 SXM)", 450.0, 10.0),
    Link("PCIe Gen5 x16", 64.0, 15.0),
    Link("PCIe Gen4 x16", 32.0, 15.0),
    Link("InfiniBand NDR 400 Gb/s", 50.0, 10.0),
    Link("Ethernet 100 Gb/s", 12.5, 30.0),
    # transport_bench 2026-12-03 (50c7ed8, CPU box): 2,048 B in 0.64 ms, 58.7 MB in 32.9 ms (p50)
    Link(
        "Ray object store, same node (measured, CPU box)", 58_720_256 / (32.90e-3 - 0.64e-3) / 1e9, 640.0, measured=True
    ),
    # the same bench's KV courier (source read, RDT gloo, sink read): 2,048 B in 19.99 ms, 58.7 MB in 273.5 ms
    Link(
        "KV courier, RDT gloo (measured, CPU box)", 58_720_256 / (273.50e-3 - 19.99e-3) / 1e9, 19_990.0, measured=True
    ),
]


@dataclass(frozen=True)
class StreamTraffic:
    """What one stream of `audio_s` moves, by kind."""

    frames: int
    chunks: int
    token_chunk_bytes: int  # one full chunk's TokenChunk as Ray pickles it (window frames, context included)
    audio_chunk_bytes: int  # one full chunk's PCM16
    kv_bytes_per_token: int
    kv_bytes_mid_stream: int  # a move (drain, rebalance) halfway through
    kv_bytes_at_end: int


def chunk_count(frames: int, detok: DetokConfig) -> int:
    """Chunks of a stream under the fixed schedule (the adaptive one cuts fewer, longer ones when ahead)."""
    rest = max(0, frames - detok.first_chunk_frames)
    return 1 + math.ceil(rest / detok.chunk_frames)


def token_chunk_bytes(detok: DetokConfig) -> int:
    window = detok.left_context_frames + detok.chunk_frames + detok.right_context_frames
    frames = [[4095 + 4096 * k for k in range(CODES_PER_FRAME)] for _ in range(window)]  # codes near the top
    chunk = TokenChunk("req-0123456789abcdef", 5, frames, 40, 43, 51, False, deadline_s=1.7e9)
    return len(pickle.dumps(chunk, protocol=5))


def audio_chunk_bytes(detok: DetokConfig) -> int:
    samples = detok.chunk_frames * SNAC_SAMPLES_PER_FRAME
    return len(AudioChunk("req-0123456789abcdef", 5, b"\0" * (2 * samples), SNAC_SAMPLE_RATE_HZ, False).pcm16)


def stream_traffic(detok: DetokConfig, kv_bytes_per_token: int, audio_s: float = STREAM_AUDIO_S) -> StreamTraffic:
    frames = math.ceil(audio_s * SNAC_SAMPLE_RATE_HZ / SNAC_SAMPLES_PER_FRAME)
    tokens = PROMPT_TOKENS + CODES_PER_FRAME * frames
    return StreamTraffic(
        frames=frames, chunks=chunk_count(frames, detok), token_chunk_bytes=token_chunk_bytes(detok),
        audio_chunk_bytes=audio_chunk_bytes(detok), kv_bytes_per_token=kv_bytes_per_token,
        kv_bytes_mid_stream=kv_bytes_per_token * (PROMPT_TOKENS + tokens) // 2,
        kv_bytes_at_end=kv_bytes_per_token * tokens,
    )  # fmt: skip


def measured_costs(bench: dict) -> dict[str, float]:
    """The one-GPU figures the estimate compares against (graphs, max_seq_len 1024, 128 rows)."""
    step = next(r for r in bench["decode_step_ms"]["results"]
                if r.get("mode") == "graphs" and r.get("rows") == 128 and r.get("max_seq_len") == 1024)  # fmt: skip
    return {"llm_step_ms_128_rows": step["step_ms"], "snac_64_chunks_ms": bench["snac_decode_ms"]["graphs_ms"]["64"],
            "kv_bytes_per_token": bench["decode_step_ms"]["kv_bytes_per_token"]}  # fmt: skip


def link_rows(traffic: StreamTraffic, rates: list[float], streams_per_replica: int) -> list[dict]:
    rows = []
    for link in LINKS:
        kv_move_ms = link.transfer_ms(traffic.kv_bytes_mid_stream)
        row = {"link": link.name, "effective_gb_s": round(link.effective_b_s / 1e9, 1),
               "token_chunk_ms": link.transfer_ms(traffic.token_chunk_bytes),
               "audio_chunk_ms": link.transfer_ms(traffic.audio_chunk_bytes),
               "kv_move_mid_stream_ms": kv_move_ms,
               "drain_full_replica_s": streams_per_replica * kv_move_ms / 1e3}  # fmt: skip
        for rate in rates:
            chunk_bytes_s = rate * traffic.chunks * (traffic.token_chunk_bytes + traffic.audio_chunk_bytes)
            row[f"chunk_traffic_pct_at_{rate:g}_rps"] = 100.0 * chunk_bytes_s / link.effective_b_s
        rows.append(row)
    return rows


def estimate(config_path: Path, bench_path: Path, rates: list[float]) -> dict:
    config = load_serve_config(config_path, check_files=False)
    measured = measured_costs(json.loads(bench_path.read_text()))
    traffic = stream_traffic(config.engine.detok, int(measured["kv_bytes_per_token"]))
    streams_per_replica = config.admission.max_streams_per_replica
    return {
        "config": str(config_path.relative_to(ROOT)), "bench": str(bench_path.relative_to(ROOT)),
        "assumptions": {"efficiency": EFFICIENCY, "stream_audio_s": STREAM_AUDIO_S, "prompt_tokens": PROMPT_TOKENS,
                        "links": [asdict(link) for link in LINKS],
                        "schedule": "fixed (first chunk, then full chunks); the adaptive one cuts fewer"},
        "measured_one_gpu": measured, "stream": asdict(traffic), "streams_per_replica": streams_per_replica,
        "playback_budget_ms": {"first_chunk": 1e3 * config.engine.detok.first_chunk_frames * SNAC_SAMPLES_PER_FRAME
                               / SNAC_SAMPLE_RATE_HZ,
                               "later_chunk": 1e3 * config.engine.detok.chunk_frames * SNAC_SAMPLES_PER_FRAME
                               / SNAC_SAMPLE_RATE_HZ},
        "links": link_rows(traffic, rates, streams_per_replica),
    }  # fmt: skip


def table(report: dict, rates: list[float]) -> str:
    s, step_ms = report["stream"], report["measured_one_gpu"]["llm_step_ms_128_rows"]
    head = (f"stream of {STREAM_AUDIO_S} s: {s['frames']} frames, {s['chunks']} chunks; token chunk "
            f"{s['token_chunk_bytes']:,} B, audio chunk {s['audio_chunk_bytes']:,} B, "
            f"KV {s['kv_bytes_per_token']:,} B/token ({s['kv_bytes_mid_stream'] / 1e6:.1f} MB mid-stream); "
            f"LLM step {step_ms} ms at 128 rows; a later chunk plays "
            f"{report['playback_budget_ms']['later_chunk']:.0f} ms")  # fmt: skip
    cols = ["link", "GB/s", "token chunk ms", "audio chunk ms", "KV move ms", "drain replica s",
            *[f"chunks % link @{r:g} rps" for r in rates]]  # fmt: skip
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in report["links"]:
        cells = [row["link"], f"{row['effective_gb_s']:g}", f"{row['token_chunk_ms']:.3f}",
                 f"{row['audio_chunk_ms']:.3f}", f"{row['kv_move_mid_stream_ms']:.2f}",
                 f"{row['drain_full_replica_s']:.2f}",
                 *[f"{row[f'chunk_traffic_pct_at_{r:g}_rps']:.4f}" for r in rates]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=GPU_CONFIG)
    p.add_argument("--bench-json", type=Path, default=GPU_BENCH_JSON, help="a loadtest.gpu_bench JSON")
    p.add_argument("--rates", type=float, nargs="+", default=[20.0, 40.0], help="req/s of 7.2 s streams")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    report = estimate(args.config.resolve(), args.bench_json.resolve(), args.rates)
    print(table(report, args.rates))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()

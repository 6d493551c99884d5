"""S3Gen / CosyVoice 2 flow-matching detokenizer cost on this machine (random weights, fp32).

Three measurements, each printed as a markdown table and kept in `--out` (JSON):

1. `rtf`: detokenizer milliseconds per second of audio, streamed through `S3GenCodec` (per-request
   caches), B requests of `--tokens` tokens decoded together in chunks of `--chunk` tokens (each
   round hands the codec one chunk of every request: one batched forward per attention chunk).
2. `per_chunk`: one request, milliseconds per chunk against the chunk's index, ours (cached, each
   chunk computed once) vs the re-run-the-prefix baseline (the official CosyVoice 2 streaming: every
   chunk runs the flow over all tokens so far + 3 look-ahead, then HiFT on the new mel with 8 cached
   frames, as its `token2wav` does).
3. `steps`: Euler steps 10 / 5 / 2, milliseconds per second of audio at batch 1.
4. `ops`: aten ops dispatched by one chunk round (each a kernel launch on a GPU, where they bound the
   round's time eagerly) against the batch: the flow alone and the whole codec round (flow + HiFT).
5. `history`: one stream of `--history-tokens` with the estimator reading every earlier frame (exact)
   vs a bounded history (`--sink-frames` + `--window-frames`, `detok.flow_window_frames`): peak KV
   per request, CPU ms per second of audio, and how far the bounded audio lies from the exact one.

Run: `.venv/bin/python -m loadtest.flow_bench --shape tiny` and `--shape full --batches 1 4`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.messages import TokenChunk
from detok_stage.codecs.s3gen_codec import S3GenCodec
from detok_stage.flow.config import full_s3gen_config, tiny_s3gen_config
from detok_stage.flow.model import S3Gen
from llm_stage.chunking import Chunker, ChunkSchedule


def build(shape: str, steps: int | None = None, history: tuple[int, int] | None = None) -> S3GenCodec:
    """Seeded random weights; `history` (sink, window) frames: the estimator's bounded history."""
    config = tiny_s3gen_config() if shape == "tiny" else full_s3gen_config()
    codec = S3GenCodec(S3Gen.seeded(config, 0), n_timesteps=steps)
    if history is not None:
        codec.bound_flow_history(*history)
    return codec


def request_chunks(rid: str, n: int, chunk: int, vocab: int, seed: int | None = None) -> list[TokenChunk]:
    """`n` random tokens (from `seed`, else from the id) cut in `chunk`-token chunks with the stream from
    token 0 as history and 3 look-ahead tokens (S3Gen's schedule)."""
    seed = hash(rid) % 1000 if seed is None else seed
    tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    chunker = Chunker(rid, ChunkSchedule(chunk, chunk, 100_000, 3))
    return chunker.push([[int(t)] for t in tokens]) + chunker.finish()


def ms_per_audio_s(codec: S3GenCodec, batch: int, tokens: int, chunk: int) -> dict:
    per_req = [request_chunks(f"r{i}", tokens, chunk, codec.codebook_size) for i in range(batch)]
    samples = 0
    peak_cache = 0
    start, cpu = time.perf_counter(), time.process_time()
    for round_ in range(max(len(c) for c in per_req)):
        batch_chunks = [c[round_] for c in per_req if round_ < len(c)]
        peak_cache = max(peak_cache, sum(codec.cache_bytes(c.req_id) for c in batch_chunks))
        samples += sum(a.numel() for a in codec.decode_stream(batch_chunks))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    audio_s = samples / codec.sample_rate_hz
    return {
        "batch": batch, "tokens": tokens, "chunk": chunk, "steps": codec.n_timesteps, "wall_s": round(elapsed, 3),
        "audio_s": round(audio_s, 2), "ms_per_audio_s": round(1000 * elapsed / audio_s, 1),
        "cpu_ms_per_audio_s": round(1000 * cpu / audio_s, 1),
        "peak_cache_mb_per_request": round(peak_cache / batch / 2**20, 1),
    }  # fmt: skip


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (each a kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_round(codec: S3GenCodec, batch: int, chunk: int) -> dict:
    """Aten ops of the fourth chunk round of `batch` requests (the pools grown by then): the codec's whole
    round and its flow."""
    per_req = [request_chunks(f"ops{batch}-{i}", 6 * chunk, chunk, codec.codebook_size) for i in range(batch)]
    for index in range(3):
        codec.decode_stream([c[index] for c in per_req])
    flow, advance = codec.model.flow, codec.model.flow.advance
    flow_ops = OpCount()

    def counted(*args, **kwargs):
        with flow_ops:
            return advance(*args, **kwargs)

    flow.advance = counted
    try:
        with OpCount() as round_ops:
            codec.decode_stream([c[3] for c in per_req])
    finally:
        del flow.advance
    for c in per_req:
        codec.release(c[0].req_id)
    return {"batch": batch, "round_ops": round_ops.count, "flow_ops": flow_ops.count}


def history_rows(shape: str, tokens: int, sink: int, window: int) -> list[dict]:
    """One stream of `tokens` decoded with the exact history, then with the bounded one."""
    rows, exact_audio = [], None
    for label, history in (("exact", None), (f"sink {sink} + window {window}", (sink, window))):
        codec = build(shape, history=history)
        chunks = request_chunks("h", tokens, codec.config.chunk_tokens, codec.codebook_size, seed=7)
        peak, pieces = 0, []
        cpu = time.process_time()
        for chunk in chunks:
            pieces += codec.decode_stream([chunk])
            peak = max(peak, codec.cache_bytes("h"))
        cpu = time.process_time() - cpu
        audio = torch.cat(pieces)
        exact_audio = audio if exact_audio is None else exact_audio
        rows.append({
            "history": label, "tokens": tokens, "peak_cache_mb": round(peak / 2**20, 1),
            "cpu_ms_per_audio_s": round(1000 * cpu / (audio.numel() / codec.sample_rate_hz), 1),
            "max_abs_diff_vs_exact": round(float((audio - exact_audio).abs().max()), 4),
        })  # fmt: skip
    return rows


def per_chunk_curve(codec: S3GenCodec, tokens: int, chunk: int) -> list[dict]:
    chunks = request_chunks("curve", tokens, chunk, codec.codebook_size)
    model, voice = codec.model, codec.default_voice
    rows = []
    all_tokens = torch.tensor([f[0] for f in chunks[-1].frames])
    for index, c in enumerate(chunks):
        start = time.process_time()
        codec.decode_stream([c])
        ours = time.process_time() - start
        # baseline: the official streaming re-runs the flow over the whole prefix (+ look-ahead) per chunk
        end = min(len(all_tokens), c.keep_end + 3)
        start = time.process_time()
        with torch.inference_mode():
            mel = model.flow.inference(all_tokens[:end].view(1, -1), voice, codec.n_timesteps)
            new = mel[:, :, max(0, 2 * c.keep_start - 8) : 2 * c.keep_end]  # new mel + 8 cached frames
            model.mel2wav.inference(new)
        rerun = time.process_time() - start
        rows.append({"chunk": index, "tokens_so_far": c.keep_end, "ours_ms": round(1000 * ours, 1),
                     "rerun_prefix_ms": round(1000 * rerun, 1)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=100, help="tokens per request (25 Hz: 100 = 4 s)")
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: the attention chunk)")
    parser.add_argument("--curve-tokens", type=int, default=250)
    parser.add_argument("--skip", nargs="*", default=[], choices=["rtf", "per_chunk", "steps", "ops", "history"])
    parser.add_argument("--history-tokens", type=int, default=250, help="the history section's stream (250 = 10 s)")
    parser.add_argument("--sink-frames", type=int, default=100, help="the bounded history's sink (mel frames)")
    parser.add_argument("--window-frames", type=int, default=200, help="the bounded history's window (mel frames)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time = compute, robust to load)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    codec = build(args.shape)
    chunk = args.chunk or codec.config.chunk_tokens
    result: dict = {"shape": args.shape, "threads": torch.get_num_threads(), "chunk": chunk,
                    "loadavg_at_start": os.getloadavg()[0]}  # fmt: skip
    ms_per_audio_s(codec, 1, 2 * chunk, chunk)  # warm-up
    if "rtf" not in args.skip:
        result["rtf"] = [ms_per_audio_s(codec, b, args.tokens, chunk) for b in args.batches]
        print(f"\n{args.shape}: streamed, {args.tokens} tokens/request, chunk {chunk}\n")
        print("| batch | CPU ms per s of audio | wall ms per s of audio | audio s | peak cache MB/request |")
        print("|---|---|---|---|---|")
        for r in result["rtf"]:
            cells = [
                r["batch"],
                r["cpu_ms_per_audio_s"],
                r["ms_per_audio_s"],
                r["audio_s"],
                r["peak_cache_mb_per_request"],
            ]
            print("| " + " | ".join(str(c) for c in cells) + " |")
    if "per_chunk" not in args.skip:
        result["per_chunk"] = per_chunk_curve(codec, args.curve_tokens, chunk)
        print(f"\n{args.shape}: per chunk, batch 1, chunk {chunk}\n")
        print("| chunk | tokens so far | ours CPU ms | re-run prefix CPU ms |\n|---|---|---|---|")
        for r in result["per_chunk"]:
            print(f"| {r['chunk']} | {r['tokens_so_far']} | {r['ours_ms']} | {r['rerun_prefix_ms']} |")
    if "steps" not in args.skip:
        result["steps"] = [ms_per_audio_s(build(args.shape, s), 1, args.tokens, chunk) for s in (10, 5, 2)]
        print(f"\n{args.shape}: Euler steps, batch 1\n")
        print("| steps | CPU ms per s of audio | wall ms per s of audio |\n|---|---|---|")
        for r in result["steps"]:
            print(f"| {r['steps']} | {r['cpu_ms_per_audio_s']} | {r['ms_per_audio_s']} |")
    if "ops" not in args.skip:
        result["ops"] = [ops_per_round(codec, b, chunk) for b in args.batches]
        print(f"\n{args.shape}: aten ops (GPU launches) per chunk round, chunk {chunk}\n")
        print("| batch | whole round | flow | round ops per request |\n|---|---|---|---|")
        for r in result["ops"]:
            print(f"| {r['batch']} | {r['round_ops']} | {r['flow_ops']} | {r['round_ops'] / r['batch']:.0f} |")
    if "history" not in args.skip:
        result["history"] = history_rows(args.shape, args.history_tokens, args.sink_frames, args.window_frames)
        print(f"\n{args.shape}: one stream of {args.history_tokens} tokens, the estimator's history\n")
        print("| history | peak KV MB | CPU ms per s of audio | max abs diff vs exact |\n|---|---|---|---|")
        for r in result["history"]:
            cells = [r["history"], r["peak_cache_mb"], r["cpu_ms_per_audio_s"], r["max_abs_diff_vs_exact"]]
            print("| " + " | ".join(str(c) for c in cells) + " |")
    print(f"\nload average at start {result['loadavg_at_start']:.1f}, now {os.getloadavg()[0]:.1f}")
    result["loadavg_at_end"] = os.getloadavg()[0]
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

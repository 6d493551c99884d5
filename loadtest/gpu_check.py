"""The GPU paths in one prepared run, for a session that is lent a device (15 minutes in all).

On the orpheus-tiny preset, on `--device`:
1. LLM greedy decode: eager (`scheduler.cuda_graphs` off) vs CUDA graphs vs async steps
   must give the same tokens; so must seeded sampling with Orpheus' defaults (the sampler's
   tensors on the device).
2. ms per engine step at each `--rows`: eager, graphs, async, graphs + async, and their ratios.
3. Detokenizer: SNAC over full-length chunk windows, eager vs CUDA graphs (`ChunkGraphs`): max
   abs difference of the audio and ms per batch.
Prints one JSON report (also written to `--out`); exits 1 when a match check fails. With
`--device cpu` the same checks run as a smoke test (graphs fall back to eager there).
Run: `.venv/bin/python -m loadtest.gpu_check --out $OUT/gpu_check.json`
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from core.config import CacheConfig, DetokConfig, ModelConfig, SchedulerConfig
from detok_stage.codecs.snac_codec import SnacCodec
from detok_stage.graphs import ChunkGraphs
from llm_stage.engine import LLMEngine
from llm_stage.models.orpheus import OrpheusAdapter
from loadtest.decode_bench import prompts
from loadtest.step_bench import ms_per_step

MODES = {  # graphs are on by default on CUDA: eager modes turn them off
    "eager": {"cuda_graphs": False},
    "graphs": {"graphs": True},
    "async": {"async_steps": True, "cuda_graphs": False},
    "graphs+async": {"graphs": True, "async_steps": True},
}


def scheduler_fields(mode: str, rows: list[int]) -> dict:
    """Graph modes capture the derived sizes (up to the rows plus the prompt tokens a step folds
    in), so eager and graph modes fold the same prompt steps and compute the same things."""
    fields = dict(MODES[mode])
    fields.pop("graphs", None)
    return fields


def generated(adapter: OrpheusAdapter, rows: list[int], mode: str, sampling: dict, count: int) -> dict:
    """Tokens of `count` requests decoded together under `mode`."""
    engine = LLMEngine(
        adapter, CacheConfig(num_slots=count, max_seq_len=512),
        SchedulerConfig(max_batch_size=count, prefill_token_budget=4096, **scheduler_fields(mode, rows)),
    )  # fmt: skip
    params = adapter.default_sampling.model_copy(update=sampling)
    for i, prompt in enumerate(prompts(adapter, count, 16)):
        engine.add_prompt(f"r{i}", prompt, params.model_copy(update={"seed": 100 + i}))
    tokens = engine.run_to_completion()
    engine.close()
    return tokens


def decode_matches(adapter: OrpheusAdapter, rows: list[int], max_tokens: int) -> dict[str, bool]:
    """Per mode and sampling: same tokens as eager decoding."""
    out = {}
    count = max(rows)
    for name, sampling in (("greedy", {"temperature": 0.0}), ("sampled", {})):
        sampling = {**sampling, "max_tokens": max_tokens}
        reference = generated(adapter, rows, "eager", sampling, count)
        for mode in MODES:
            if mode != "eager":
                out[f"{name}/{mode}"] = generated(adapter, rows, mode, sampling, count) == reference
    return out


def step_times(adapter: OrpheusAdapter, rows: list[int], max_tokens: int) -> dict[str, dict[str, float]]:
    """ms per step per mode at each batch size, and each mode's speed-up over eager."""
    table = {}
    for count in rows:
        ms = {mode: ms_per_step(adapter, count, max_tokens, **scheduler_fields(mode, rows)) for mode in MODES}
        table[str(count)] = {**ms, **{f"{m} speedup": ms["eager"] / ms[m] for m in MODES if m != "eager"}}
    return table


def detok_check(device: str, sizes: list[int], repeats: int = 20) -> dict[str, float]:
    codec = SnacCodec.build(ModelConfig(device=device), device)
    schedule = DetokConfig()  # the wide schedule's full-length window, as ChunkGraphs.build sizes it
    window = schedule.left_context_frames + schedule.chunk_frames + schedule.right_context_frames
    graphs = ChunkGraphs(codec, window, sizes, device)
    captured = graphs.capture_all()
    frames = torch.randint(0, 4096, (max(sizes), window, codec.codes_per_frame))
    eager = codec.decode(frames)
    replayed = graphs.run(frames)
    report = {"captured": float(captured), "eager_ms": timed_ms(lambda: codec.decode(frames), repeats)}
    if replayed is not None:
        report["max_abs_diff"] = float((replayed - eager.float().cpu()).abs().max())
        report["graphs_ms"] = timed_ms(lambda: graphs.run(frames), repeats)
    return report


def timed_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=140, help="per request (140 = 20 frames)")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/gpu_check.json"))
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --device cpu for the smoke test")
    adapter = OrpheusAdapter.build(ModelConfig(device=args.device, torch_threads=1))
    report = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "matches": decode_matches(adapter, args.rows, args.max_tokens),
        "ms_per_step": step_times(adapter, args.rows, args.max_tokens),
        "detok": detok_check(args.device, sorted(set(args.rows))),
    }
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if not all(report["matches"].values()):
        sys.exit("a decode mode gave different tokens than eager decoding")


if __name__ == "__main__":
    main()

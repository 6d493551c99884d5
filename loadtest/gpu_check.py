"""The GPU paths in one prepared run, for a session that is lent a device (15 minutes in all).

On the orpheus-tiny preset, on `--device`:
1. LLM greedy decode: eager (`scheduler.cuda_graphs` off) vs CUDA graphs vs async steps
   must give the same tokens; so must seeded sampling with Orpheus' defaults (the sampler's
   tensors on the device).
2. ms per engine step at each `--rows`: eager, graphs, async, graphs + async, and their ratios.
3. Detokenizer: SNAC over full-length chunk windows, eager vs CUDA graphs (`ChunkGraphs`): max
   abs difference of the audio and ms per batch.
4. Speech in: step-audio2-tiny answering clips (encoder, placeholder prompts, text + speech tokens),
   greedy and seeded: CUDA graphs must give eager's tokens (its decode forward embeds sampled tokens
   alone, `decode_embed`; its prompts never fold).
Prints one JSON report (also written to `--out`); exits 1 when a match check fails. With
`--device cpu` the same checks run as a smoke test (graphs fall back to eager there).
Run: `.venv/bin/python -m loadtest.gpu_check --out $OUT/gpu_check.json`
"""

from __future__ import annotations

import argparse
import dataclasses
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
from llm_stage.models.step_audio2 import StepAudio2Adapter
from loadtest.decode_bench import prompts
from loadtest.speech_in_bench import tone_clip
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


def speech_in_tokens(device: str, mode: str, sampling: dict, count: int = 3) -> dict:
    """Tokens of `count` step-audio2-tiny requests, each with its own clip, decoded together under `mode`."""
    adapter = StepAudio2Adapter.build(ModelConfig(name="step-audio2-tiny", device=device, torch_threads=1))
    engine = LLMEngine(
        adapter, CacheConfig(num_slots=count, max_seq_len=1024),
        SchedulerConfig(max_batch_size=count, prefill_token_budget=512, **scheduler_fields(mode, [count])),
    )  # fmt: skip
    for i in range(count):
        job = engine.job(f"s{i}", "Answer.", sampling={**sampling, "seed": 100 + i})
        engine.add_job(dataclasses.replace(job, audio=tone_clip(1.0 + 0.7 * i)))
    tokens = engine.run_to_completion()
    engine.close()
    return tokens


def speech_in_matches(device: str, max_tokens: int) -> dict[str, bool]:
    """Step-Audio 2, greedy and seeded: CUDA graphs give eager's tokens."""
    out = {}
    for name, sampling in (("greedy", {"temperature": 0.0}), ("sampled", {})):
        sampling = {**sampling, "max_tokens": max_tokens}
        reference = speech_in_tokens(device, "eager", sampling)
        out[f"step-audio2/{name}/graphs"] = speech_in_tokens(device, "graphs", sampling) == reference
    return out


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
    try:  # (a family never run on a GPU before: its failure is reported, not the end of the other checks)
        report["matches"].update(speech_in_matches(args.device, args.max_tokens))
    except Exception as err:
        report["matches"]["step-audio2"] = False
        report["speech_in_error"] = f"{type(err).__name__}: {err}"
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if not all(report["matches"].values()):
        sys.exit("a decode mode gave different tokens than eager decoding")


if __name__ == "__main__":
    main()

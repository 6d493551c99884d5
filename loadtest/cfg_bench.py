"""CFG retention benchmark: audio tokens/s with classifier-free guidance vs without, one run.

Same model, same concurrency, same requests: N streams without CFG, then the same N streams
each with a hidden unconditional twin (paired co-scheduling). Prints both rates and their
ratio (retention). Usage: python -m loadtest.cfg_bench --concurrency 16 --max-tokens 200
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from llm_stage.engine import LLMEngine
from llm_stage.models.base import LMAdapter
from llm_stage.registry import check_model_config


def fixed_length(adapter: LMAdapter) -> LMAdapter:
    """Keep codebook 0 off EOS (the length-limit cascade still ends each stream), so both modes do equal work."""
    eos_id = adapter.layout.eos_id  # type: ignore[attr-defined]
    model_rules = adapter.constrain

    def constrain(logits: torch.Tensor, reqs: list) -> torch.Tensor:
        logits[:, 0, eos_id] = float("-inf")
        return model_rules(logits, reqs)

    adapter.constrain = constrain  # type: ignore[method-assign]
    return adapter


def run_once(adapter: LMAdapter, args: argparse.Namespace, scale: float | None) -> dict[str, float]:
    """N concurrent requests to completion; audio tokens = emitted frames x codebooks."""
    rows = 2 * args.concurrency  # room for the twins; the unguided run simply leaves half unused
    engine = LLMEngine(
        adapter, CacheConfig(num_slots=rows, max_seq_len=args.max_tokens + args.prompt_room),
        SchedulerConfig(max_batch_size=rows, prefill_token_budget=4096), seed=0,
    )  # fmt: skip
    sampling = {"temperature": 0.9, "top_k": 50, "max_tokens": args.max_tokens, "guidance_scale": scale}
    for i in range(args.concurrency):
        engine.add_request(f"r{i}", f"benchmark sentence number {i}", None, {**sampling, "seed": i})
    frames, steps = 0, 0
    _sync(args.device)
    start = time.perf_counter()
    while engine.has_work:
        frames += sum(len(out.new_frames) for out in engine.step())
        steps += 1
    _sync(args.device)
    elapsed = time.perf_counter() - start
    tokens = frames * adapter.num_codebooks
    return {"audio_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "steps": steps}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="parallel-heads-tiny")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--guidance-scale", type=float, default=3.0)
    parser.add_argument("--prompt-room", type=int, default=64, help="KV positions per row beyond max_tokens")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per mode; the best is kept")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ModelConfig(name=args.model, device=args.device)
    adapter = fixed_length(check_model_config(config).build_lm(config))
    run_once(adapter, argparse.Namespace(**{**vars(args), "concurrency": 2, "max_tokens": 20}), None)  # warm-up
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, scale in (("no_cfg", None), ("cfg", args.guidance_scale)):
            result = run_once(adapter, args, scale)
            if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = result
    report = {**best, "retention": best["cfg"]["tokens_per_s"] / best["no_cfg"]["tokens_per_s"], "args": vars(args)}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

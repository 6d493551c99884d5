"""Time to first text of a conversation's turns, with and without what a replica keeps between turns (issue 39).

A speech-in family's tiny preset (`--model`) on one `LLMEngine` on this machine: a conversation of `--turns`
turns, each a user clip of `--clip-s` seconds answered in text (greedy, `--max-tokens`), each turn's history
the earlier turns (every clip and a fixed answer text). Three ways, each its own engine and adapter state:
`nothing_kept` (every turn prefills and encodes the whole conversation: before issue 39's reuse), `clips_kept`
(the clips' tokens / encoded rows kept by content, the prompt KV not: `cache.keep_prompts` off), `all_kept`
(the last turn's prompt KV kept in its slot as well: the default). Per turn: its time to first text (from
submit to the first token, in-process: no Router, no detok), the positions reused and the prompt length;
per way the median over `--repeats` conversations; ratios against `nothing_kept`. Random weights: the work per
position is the model's. Prints one JSON object (also written to `--out`).
Run: `.venv/bin/python -m loadtest.conversation_bench --model glm4-voice-tiny --turns 6 --clip-s 8 --repeats 3`
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from core.messages import ChatTurn, Job
from llm_stage.engine import LLMEngine
from llm_stage.jobs import build_job
from llm_stage.registry import get_entry
from loadtest.speech_in_latency import tone_clip

WAYS = {"nothing_kept": (False, False), "clips_kept": (False, True), "all_kept": (True, True)}  # (KV, clips)
ANSWER = "Sure, here is what I heard."


def turn_job(adapter, turn: int, clip_s: float, max_tokens: int, tag: str) -> Job:
    """Turn `turn` (0-based): its own clip, after every earlier clip and the fixed answer to it."""
    clips = [tone_clip(clip_s + 0.01 * k) for k in range(turn + 1)]  # (lengths differ: distinct clips)
    history = tuple(t for c in clips[:-1] for t in (ChatTurn("user", "", c), ChatTurn("assistant", ANSWER)))
    sampling = {"temperature": 0.0, "max_tokens": max_tokens}
    return build_job(adapter, text="", audio=clips[-1], history=history, sampling=sampling, text_only=True,
                     req_id=f"{tag}-turn{turn}")  # fmt: skip


def first_text_s(engine: LLMEngine, job: Job) -> float:
    """From the submit (its prompt built, its clips encoded) to its first token; then the answer runs out."""
    start = time.perf_counter()
    engine.add_job(job)
    first = None
    while engine.has_work:
        for out in engine.step():
            if first is None and out.req_id == job.req_id and out.new_token_ids:
                first = time.perf_counter() - start
    return first if first is not None else float("nan")


def conversation(model: str, way: str, args: argparse.Namespace, tag: str) -> list[dict]:
    keep_kv, keep_clips = WAYS[way]
    entry = get_entry(model)
    adapter = entry.build_lm(ModelConfig(name=model, seed=1))
    engine = LLMEngine(adapter, CacheConfig(num_slots=4, max_seq_len=args.max_seq_len, keep_prompts=keep_kv),
                       SchedulerConfig(max_batch_size=4, prefill_token_budget=args.prefill_budget))  # fmt: skip
    first_text_s(engine, turn_job(adapter, 0, 0.5, 2, f"{tag}-warm"))  # lazy inits, allocator
    engine.scheduler.give_back_kept()
    adapter.forget_kept_clips()
    rows = []
    for turn in range(args.turns):
        if not keep_clips:
            adapter.forget_kept_clips()
        job = turn_job(adapter, turn, args.clip_s, args.max_tokens, tag)
        reused_before = engine.scheduler.kept.num_reused_positions
        seconds = first_text_s(engine, job)
        rows.append({"turn": turn, "first_text_s": seconds,
                     "reused_positions": engine.scheduler.kept.num_reused_positions - reused_before})  # fmt: skip
    return rows


def summarize(runs: dict[str, list[list[dict]]]) -> dict:
    out = {}
    for way, conversations in runs.items():
        turns = []
        for turn in range(len(conversations[0])):
            seconds = [c[turn]["first_text_s"] for c in conversations]
            turns.append({"turn": turn, "first_text_s": round(statistics.median(seconds), 4),
                          "reused_positions": conversations[0][turn]["reused_positions"]})  # fmt: skip
        out[way] = turns
    base = out["nothing_kept"]
    for way in WAYS:
        for row, before in zip(out[way], base, strict=True):
            row["vs_nothing_kept"] = round(row["first_text_s"] / before["first_text_s"], 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="glm4-voice-tiny", choices=["glm4-voice-tiny", "step-audio2-tiny"])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--clip-s", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8, help="per answer (the first text comes first)")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--prefill-budget", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("bench_out/conversation_bench.json"))
    args = parser.parse_args(argv)
    runs: dict[str, list[list[dict]]] = {way: [] for way in WAYS}
    for repeat in range(args.repeats):  # the ways interleaved, so load on the box falls on each alike
        for way in WAYS:
            runs[way].append(conversation(args.model, way, args, f"{way}-{repeat}"))
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "by_way": summarize(runs)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()

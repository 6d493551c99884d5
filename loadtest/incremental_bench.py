"""Time from an agent's first text token to the first audio: incremental text (words typed into the
WebSocket as an LLM writes them) vs whole text (the same words sent once the last one is written),
against a running server. One stream at a time, the two modes alternate per reply; with
`--streams N`, N clients run at once, half of them incremental, and each mode's share of viable
streams (every chunk on time, DESIGN §1) is reported too.

Usage (with `voxray serve` running): python -m loadtest.incremental_bench --pace 30 --trials 5 [--streams 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ThreadPoolExecutor

from cluster.incremental_client import IncrementalResult, type_text
from loadtest.metrics import worst_underrun_s

REPLIES = [
    "Sure, I can help with that. Your order shipped this morning and should arrive on Thursday.",
    "Good question. The short answer is yes, but there are a couple of things to check first.",
    "Let me look that up for you. It seems the store opens at nine and closes at six today.",
    "Thanks for waiting. I have moved your appointment to Friday at ten, as you asked.",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(results: dict[str, list[IncrementalResult]]) -> dict:
    """Per mode: first-piece -> first-audio p50 / p90 and the share of streams without an underrun."""
    out = {}
    for mode, done in results.items():
        ok = [r for r in done if r.first_audio_s is not None and r.error is None]
        if not ok:
            continue
        firsts = [r.first_audio_s for r in ok]
        viable = [worst_underrun_s(r.chunk_arrivals_s, r.chunk_durations_s) == 0.0 for r in ok]
        out[mode] = {
            "n": len(ok), "failures": len(done) - len(ok), "p50_s": statistics.median(firsts),
            "p90_s": percentile(firsts, 0.9), "pct_viable": 100.0 * sum(viable) / len(ok),
        }  # fmt: skip
    return out


def run_concurrent(url: str, pace: float, trials: int, max_tokens: int, num_streams: int) -> dict:
    """`num_streams` clients at once, even ones incremental, odd ones whole text, each through
    the replies `trials` times."""

    def client(index: int) -> list[IncrementalResult]:
        whole = index % 2 == 1
        runs = []
        for trial in range(trials):
            for k, reply in enumerate(REPLIES):
                config = {"sampling": {"seed": index * 1000 + trial * 100 + k, "max_tokens": max_tokens}}
                runs.append(type_text(url, reply, config, pace, whole_text=whole))
        return runs

    with ThreadPoolExecutor(num_streams) as pool:
        per_client = list(pool.map(client, range(num_streams)))
    results = {"incremental": [], "whole_text": []}
    for index, runs in enumerate(per_client):
        results["whole_text" if index % 2 else "incremental"].extend(runs)
    return {"pace_words_per_s": pace, "streams": num_streams, **summary(results)}


def run(url: str, pace: float, trials: int, max_tokens: int) -> dict:
    """One stream at a time, each reply in both modes (alternating which goes first)."""
    results: dict[str, list[IncrementalResult]] = {"incremental": [], "whole_text": []}
    for trial in range(trials):
        for index, reply in enumerate(REPLIES):
            config = {"sampling": {"seed": trial * 100 + index, "max_tokens": max_tokens}}
            for mode in ("incremental", "whole_text") if (trial + index) % 2 == 0 else ("whole_text", "incremental"):
                results[mode].append(type_text(url, reply, config, pace, whole_text=mode == "whole_text"))
    return {"pace_words_per_s": pace, "streams": 1, **summary(results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/audio/speech/stream")
    parser.add_argument("--pace", type=float, default=30.0, help="words (~ LLM tokens) per second")
    parser.add_argument("--trials", type=int, default=3, help="rounds over the replies, each in both modes")
    parser.add_argument("--max-tokens", type=int, default=70, help="per segment (orpheus: 7 per frame)")
    parser.add_argument("--streams", type=int, default=1, help="clients at once, half of them incremental")
    args = parser.parse_args()
    if args.streams > 1:
        report = run_concurrent(args.url, args.pace, args.trials, args.max_tokens, args.streams)
    else:
        report = run(args.url, args.pace, args.trials, args.max_tokens)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Time from an agent's first text token to the first audio: incremental text (words typed into the
WebSocket as an LLM writes them) vs whole text (the same words sent once the last one is written),
against a running server. One stream at a time, the two modes alternate per reply; with
`--streams N`, N clients run at once, half of them incremental, and each mode's share of viable
streams (every chunk on time, DESIGN §1) is reported too. With `--rates`, a Poisson sweep: streams
arrive at each rate for `--duration-s`, every other one incremental.

Usage (with `voxray serve` running): python -m loadtest.incremental_bench --pace 30 --trials 5 [--streams 4]
    python -m loadtest.incremental_bench --pace 30 --rates 0.5,1,2 --duration-s 30
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
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


def poisson_offsets_s(rate_per_s: float, duration_s: float, seed: int) -> list[float]:
    rng, offsets, at_s = random.Random(seed), [], 0.0
    while (at_s := at_s + rng.expovariate(rate_per_s)) < duration_s:
        offsets.append(at_s)
    return offsets


def run_poisson(url: str, pace: float, rate_per_s: float, duration_s: float, max_tokens: int) -> dict:
    """Streams arriving as a Poisson process at `rate_per_s` for `duration_s`, every other one incremental
    (the replies in turn); each mode's first-piece -> first-audio and viability."""
    offsets = poisson_offsets_s(rate_per_s, duration_s, seed=round(rate_per_s * 1000))
    start_s = time.monotonic() + 0.5

    def client(index: int) -> tuple[str, IncrementalResult]:
        time.sleep(max(0.0, start_s + offsets[index] - time.monotonic()))
        whole = index % 2 == 1
        config = {"sampling": {"seed": index, "max_tokens": max_tokens}}
        return ("whole_text" if whole else "incremental"), type_text(url, REPLIES[index % 4], config, pace, whole)

    with ThreadPoolExecutor(max(1, len(offsets))) as pool:
        done = list(pool.map(client, range(len(offsets))))
    results: dict[str, list[IncrementalResult]] = {"incremental": [], "whole_text": []}
    for mode, result in done:
        results[mode].append(result)
    return {"pace_words_per_s": pace, "rate_per_s": rate_per_s, "streams": len(offsets), **summary(results)}


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
    parser.add_argument("--rates", default="", help="Poisson sweep: arrival rates (streams/s), comma-separated")
    parser.add_argument("--duration-s", type=float, default=30.0, help="arrivals per rate of the sweep")
    args = parser.parse_args()
    if args.rates:
        rates = [float(rate) for rate in args.rates.split(",")]
        sweep = [run_poisson(args.url, args.pace, rate, args.duration_s, args.max_tokens) for rate in rates]
        print(json.dumps(sweep, indent=2))
        return
    if args.streams > 1:
        report = run_concurrent(args.url, args.pace, args.trials, args.max_tokens, args.streams)
    else:
        report = run(args.url, args.pace, args.trials, args.max_tokens)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

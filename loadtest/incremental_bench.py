"""Time from an agent's first text token to the first audio: incremental text (words typed into the
WebSocket as an LLM writes them) vs whole text (the same words sent once the last one is written),
against a running server, alternating the two modes per reply so both see the same load.

Usage (with `voxray serve` running): python -m loadtest.incremental_bench --pace 30 --trials 5
"""

from __future__ import annotations

import argparse
import json
import statistics

from cluster.incremental_client import IncrementalResult, type_text

REPLIES = [
    "Sure, I can help with that. Your order shipped this morning and should arrive on Thursday.",
    "Good question. The short answer is yes, but there are a couple of things to check first.",
    "Let me look that up for you. It seems the store opens at nine and closes at six today.",
    "Thanks for waiting. I have moved your appointment to Friday at ten, as you asked.",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(url: str, pace: float, trials: int, max_tokens: int) -> dict:
    """Per mode: the first-piece -> first-audio times (s) of every reply that produced audio."""
    times: dict[str, list[float]] = {"incremental": [], "whole_text": []}
    failures = 0
    for trial in range(trials):
        for index, reply in enumerate(REPLIES):
            config = {"sampling": {"seed": trial * 100 + index, "max_tokens": max_tokens}}
            for mode in ("incremental", "whole_text") if (trial + index) % 2 == 0 else ("whole_text", "incremental"):
                result: IncrementalResult = type_text(url, reply, config, pace, whole_text=mode == "whole_text")
                if result.first_audio_s is None or result.error is not None:
                    failures += 1
                    continue
                times[mode].append(result.first_audio_s)
    summary = {
        mode: {"n": len(v), "p50_s": statistics.median(v), "p90_s": percentile(v, 0.9)}
        for mode, v in times.items()
        if v
    }
    return {"pace_words_per_s": pace, "failures": failures, **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/audio/speech/stream")
    parser.add_argument("--pace", type=float, default=30.0, help="words (~ LLM tokens) per second")
    parser.add_argument("--trials", type=int, default=3, help="rounds over the replies, each in both modes")
    parser.add_argument("--max-tokens", type=int, default=70, help="per segment (orpheus: 7 per frame)")
    args = parser.parse_args()
    print(json.dumps(run(args.url, args.pace, args.trials, args.max_tokens), indent=2))


if __name__ == "__main__":
    main()

"""Time to first text and first audio against the length of the user's audio (issue 39), in process.

A speech-in family's tiny preset (`--model`: `step-audio2-tiny`, its audio encoder's embeddings in the
prompt, or `glm4-voice-tiny`, its WhisperVQ speech tokens) through `cluster.pipeline.InProcessPipeline` on this
machine: for each clip length, a spoken answer (text + speech) and a text-only answer (no speech: the
published ASR prompt's turn), each from a fresh submit on a warmed pipeline, greedy; the medians of
`--repeats` answers of time to first text and first audio, from submission. The clip's encoder
forward and its longer prefill are what grows with its length: the text-only answer's first text
(its first token) shows that alone. Random weights: the text the model says is noise, but the work
per position is the model's; a greedy answer is the same on every repeat, and how many text ids it
says before its first speech id (random weights decide) moves the spoken answer's first audio.
Prints one JSON object (also written to `--out`).
Run: `.venv/bin/python -m loadtest.speech_in_latency --seconds 1 5 10 25 50 --repeats 5`
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from cluster.pipeline import InProcessPipeline
from core.config import EngineConfig, ModelConfig
from core.messages import AudioClip
from llm_stage.jobs import build_job

SAMPLE_RATE_HZ = 16_000


def tone_clip(seconds: float) -> AudioClip:
    """A clip the audio checks accept (not silent): a 200 Hz tone at -10 dBFS, PCM16 at 16 kHz."""
    t = np.arange(int(seconds * SAMPLE_RATE_HZ)) / SAMPLE_RATE_HZ
    return AudioClip((0.3 * np.sin(2 * np.pi * 200 * t) * 32767).astype("<i2").tobytes(), SAMPLE_RATE_HZ)


def median_or_none(values: list[float | None]) -> float | None:
    measured = [v for v in values if v is not None]
    return round(statistics.median(measured), 4) if measured else None


def first_outputs(pipeline: InProcessPipeline, seconds: float, text_only: bool, repeats: int, max_tokens: int) -> dict:
    adapter = pipeline.llm.engine.adapter
    firsts = []
    for i in range(repeats):
        job = build_job(adapter, text="", req_id=f"latency-{seconds}-{text_only}-{i}", audio=tone_clip(seconds),
                        sampling={"temperature": 0.0, "max_tokens": max_tokens}, text_only=text_only)  # fmt: skip
        answer = pipeline.answer(job)
        firsts.append((answer.first_text_s, answer.first_audio_s))
    return {
        "first_text_s": median_or_none([text for text, _ in firsts]),
        "first_audio_s": median_or_none([audio for _, audio in firsts]),
        "answers_with_text": sum(text is not None for text, _ in firsts),
    }


def run(seconds: list[float], repeats: int, max_tokens: int, model: str = "step-audio2-tiny") -> dict:
    pipeline = InProcessPipeline(EngineConfig(model=ModelConfig(name=model, seed=1)))
    try:
        first_outputs(pipeline, seconds[0], False, 1, max_tokens)  # warm: lazy inits, allocator
        rows = {}
        for length in seconds:
            rows[str(length)] = {
                "spoken": first_outputs(pipeline, length, False, repeats, max_tokens),
                "text_only": first_outputs(pipeline, length, True, repeats, max_tokens),
            }
        return {"model": model, "repeats": repeats, "max_tokens": max_tokens, "by_clip_s": rows}
    finally:
        pipeline.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="step-audio2-tiny", choices=["step-audio2-tiny", "glm4-voice-tiny"])
    parser.add_argument("--seconds", type=float, nargs="+", default=[1, 5, 10, 25, 50])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=60, help="per answer (the first outputs come early)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/speech_in_latency.json"))
    args = parser.parse_args(argv)
    report = run(args.seconds, args.repeats, args.max_tokens, args.model)
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

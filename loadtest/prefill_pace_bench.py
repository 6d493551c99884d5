"""The prefill pace an LLM replica reports for admission (issue 39): speech-in requests with clips of
several lengths run one after another through an in-process engine (the replica's, `build_llm_side`),
then the figures its load report would carry: prompt positions per second beyond a decode step and
the front end's and encoder's seconds per second of audio (`llm_stage.prefill_pace`), beside each clip's estimated and
actual prompt positions; then, on the idle engine, a text-only answer per clip: its first text as
admission predicts it from those figures (`router.admission.first_chunk_s`) and as measured from the
job's add. Prints one JSON object.
Run: `.venv/bin/python -m loadtest.prefill_pace_bench [--model step-audio2-tiny] [--clips 2 5 10 25]`.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from core.config import EngineConfig, ModelConfig
from core.messages import AudioClip
from llm_stage.jobs import build_job
from llm_stage.prompt_work import prompt_work
from llm_stage.side import LLMSide
from llm_stage.wiring import build_llm_side
from router.admission import ReplicaLoad, first_chunk_s

SAMPLE_RATE_HZ = 16_000


def speech_like_clip(seconds: float) -> AudioClip:
    t = np.arange(round(seconds * SAMPLE_RATE_HZ)) / SAMPLE_RATE_HZ
    wave = 0.3 * np.sin(2 * np.pi * 200 * t) + 0.05 * np.random.default_rng(0).standard_normal(t.size)
    return AudioClip((wave * 32767).astype("<i2").tobytes(), SAMPLE_RATE_HZ)


def run_clip(side: LLMSide, req_id: str, seconds: float, max_tokens: int) -> dict:
    """One speech-in request (greedy, `max_tokens`) run to its end: its estimated and actual positions."""
    engine = side.engine
    job = build_job(engine.adapter, text="", audio=speech_like_clip(seconds), req_id=req_id,
                    sampling={"temperature": 0.0, "max_tokens": max_tokens})  # fmt: skip
    estimated = prompt_work(type(engine.adapter), job).num_positions
    side.add(job)
    actual = len(engine.requests[req_id].prompt_ids)
    while engine.has_work:
        side.step()
    return {"clip_s": seconds, "estimated_positions": estimated, "prompt_positions": actual}


def first_text(side: LLMSide, load: ReplicaLoad, req_id: str, seconds: float) -> dict:
    """A text-only answer on the idle engine: its first text predicted and measured (from its add)."""
    engine = side.engine
    job = build_job(engine.adapter, text="", audio=speech_like_clip(seconds), req_id=req_id, text_only=True,
                    sampling={"temperature": 0.0, "max_tokens": 4})  # fmt: skip
    predicted_s = first_chunk_s(load, prompt_work(type(engine.adapter), job))
    start = time.perf_counter()
    side.add(job)
    measured_s = None
    while engine.has_work:
        side.step()
        if measured_s is None and any(d.text for d in side.take_text() if d.req_id == req_id):
            measured_s = time.perf_counter() - start
    measured = None if measured_s is None else round(measured_s, 4)
    return {"clip_s": seconds, "predicted_first_text_s": round(predicted_s, 4), "measured_first_text_s": measured}


def paced_load(side: LLMSide) -> ReplicaLoad:
    """The figures an idle replica's report carries for the prediction (`LLMStage.load`: the step, the
    prefill pace and budget, the front end and encoder)."""
    engine, pace = side.engine, side.engine.prefill_pace
    step_s = engine.timer.measured_step_s
    return ReplicaLoad(num_active=0, max_streams=1, max_queued=0, step_s=step_s, first_chunk_tokens=0,
                       avg_stream_s=0.0, prefill_tokens_per_s=pace.tokens_per_s(step_s),
                       encoder_s_per_audio_s=pace.encoder_s_per_audio_s(),
                       front_end_s_per_audio_s=pace.front_end_s_per_audio_s(),
                       prefill_token_budget=engine.scheduler.config.prefill_token_budget)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="step-audio2-tiny")
    parser.add_argument("--clips", type=float, nargs="+", default=[2.0, 5.0, 10.0, 25.0, 5.0, 10.0, 25.0])
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    side = build_llm_side(EngineConfig(model=ModelConfig(name=args.model, torch_threads=args.torch_threads)))
    clips = [run_clip(side, f"r{i}", seconds, args.max_tokens) for i, seconds in enumerate(args.clips)]
    load = paced_load(side)
    texts = [first_text(side, load, f"t{i}", seconds) for i, seconds in enumerate(sorted(set(args.clips)))]
    report = {
        "model": args.model,
        "steady_step_s": round(load.step_s, 5),
        "prefill_tokens_per_s": round(load.prefill_tokens_per_s, 1),
        "encoder_s_per_audio_s": round(load.encoder_s_per_audio_s, 5),
        "front_end_s_per_audio_s": round(load.front_end_s_per_audio_s, 5),
        "prefill_token_budget": load.prefill_token_budget,
        "clips": clips,
        "text_only_first_text": texts,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()

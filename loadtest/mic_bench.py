"""What streamed microphone input leaves for the end of a turn (issue 39): Step-Audio 2's front end
(resampling + log-mel) run on 20 ms pieces as they arrive, against the same front end and the
published one run on the whole clip at the end, and the encoder + adapter (tiny preset) that still
runs at the end of the turn. Per turn length and input rate: the median and worst cost of one 20 ms
piece, the `finish()` left at end of turn, the whole-clip front ends, the tiny encoder over the
turn's pieces. Prints one JSON object. Run: `.venv/bin/python -m loadtest.mic_bench [--repeats 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from core.config import ModelConfig
from core.messages import AudioClip
from llm_stage.models.clip_audio import clip_wave_16k
from llm_stage.models.step_audio2 import StepAudio2Adapter
from llm_stage.models.step_audio2_encoder import encode_pieces, piece_log_mel, split_pieces
from llm_stage.models.step_audio2_frontend import MicFrontEnd

PIECE_S = 0.02  # a microphone client's usual piece


def speech_like_pcm16(seconds: float, rate: int) -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    noise = 0.01 * np.random.default_rng(0).normal(size=t.size)
    wave = 0.2 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t)) + noise  # a tone at a syllable rate
    return np.clip(wave * 32767, -32768, 32767).astype("<i2").tobytes()


def timed_s(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def streamed_costs(pcm: bytes, rate: int) -> tuple[list[float], float, list[torch.Tensor]]:
    """Each 20 ms piece's front-end time, the finish time, and the mels."""
    front, step = MicFrontEnd(rate), 2 * round(PIECE_S * rate)
    pieces = [timed_s(lambda s=start: front.push_pcm16(pcm[s : s + step])) for start in range(0, len(pcm), step)]
    start = time.perf_counter()
    features = front.finish()
    return pieces, time.perf_counter() - start, [torch.from_numpy(m) for m in features.mels]


def turn_costs(seconds: float, rate: int, repeats: int, adapter: StepAudio2Adapter) -> dict:
    pcm = speech_like_pcm16(seconds, rate)
    runs = [streamed_costs(pcm, rate) for _ in range(repeats)]
    pieces = [p for run in runs for p in run[0]]
    mels = runs[0][2]
    whole = MicFrontEnd(rate)
    model = adapter.model
    return {
        "piece_median_ms": round(1e3 * statistics.median(pieces), 3),
        "piece_max_ms": round(1e3 * max(pieces), 2),
        "streamed_total_ms": round(1e3 * statistics.median(sum(r[0]) + r[1] for r in runs), 2),
        "finish_at_end_of_turn_ms": round(1e3 * statistics.median(r[1] for r in runs), 2),
        "whole_clip_front_end_ms": round(1e3 * statistics.median(
            timed_s(lambda: (whole.__init__(rate), whole.push_pcm16(pcm), whole.finish())) for _ in range(repeats)), 2),
        "published_front_end_ms": round(1e3 * statistics.median(timed_s(lambda: [piece_log_mel(p) for p in split_pieces(
            clip_wave_16k(AudioClip(pcm, rate)))]) for _ in range(repeats)), 2),
        "tiny_encoder_ms": round(1e3 * statistics.median(
            timed_s(lambda: encode_pieces(model.encoder, model.adapter, mels)) for _ in range(repeats)), 2),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    adapter = StepAudio2Adapter.build(ModelConfig(name="step-audio2-tiny", seed=0))
    result = {"threads": torch.get_num_threads()}
    for seconds in (5.0, 25.0):
        for rate in (16_000, 24_000, 48_000):
            result[f"{seconds:g}s@{rate}"] = turn_costs(seconds, rate, args.repeats, adapter)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

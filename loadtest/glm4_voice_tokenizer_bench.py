"""What GLM-4-Voice's speech tokenizer leaves for the end of a user's turn (issue 39), at the published
sizes with random weights (`TokenizerShape()`: 128 mels, d 1280, 16 layers, 16384 codes, 4 s blocks):
the whole clip tokenized at the end (`SpeechTokenizer.tokens`) against the streamed path
(`MicTokenizer`, 20 ms pieces as they arrive), whose `finish()` runs the turn's last block and any block
the final log-mel floor made stale. Per turn length and signal, in CPU seconds (one thread by default):
the whole clip, the streamed turn's summed pushes and worst 20 ms piece, its finish, and the blocks
finish encoded. Prints one JSON object. Run: `.venv/bin/python -m loadtest.glm4_voice_tokenizer_bench
[--seconds 6 12] [--device cuda]`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from llm_stage.models.glm4_voice_stream import MicTokenizer
from llm_stage.models.glm4_voice_tokenizer import SpeechTokenizer, TokenizerShape

PIECE_SAMPLES = 320  # 20 ms at 16 kHz


def speech_like(seconds: float) -> torch.Tensor:
    """A tone at a syllable rate plus faint noise: its max creeps up and narrow mel bins dip under the floor."""
    t = torch.arange(round(seconds * 16_000)) / 16_000
    noise = 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(0))
    return 0.2 * torch.sin(2 * torch.pi * 180 * t) * (1 + torch.sin(2 * torch.pi * 3 * t)) + noise


def steady_noise(seconds: float) -> torch.Tensor:
    """Stationary noise: no frame lies 80 dB under the max, so no early block goes stale."""
    return 0.1 * torch.randn(round(seconds * 16_000), generator=torch.Generator().manual_seed(1))


SIGNALS = {"speech_like": speech_like, "steady_noise": steady_noise}


def timed_s(run) -> float:
    """The process's CPU seconds for `run` (one thread by default: a cost, steady on a shared box)."""
    start = time.process_time()
    run()
    return time.process_time() - start


def one_turn(tokenizer: SpeechTokenizer, signal: str, seconds: float) -> dict:
    wave = SIGNALS[signal](seconds)
    whole_s = timed_s(lambda: tokenizer.tokens([wave]))
    mic = MicTokenizer(tokenizer)
    pushes = [timed_s(lambda p=p: mic.push_wave(p)) for p in torch.split(wave, PIECE_SAMPLES)]
    finish_s = timed_s(mic.finish)
    return {
        "signal": signal, "turn_s": seconds, "whole_clip_s": round(whole_s, 3),
        "streamed_push_total_s": round(sum(pushes), 3), "worst_piece_s": round(max(pushes), 3),
        "finish_s": round(finish_s, 3), "blocks_left_at_finish": mic.window.num_encoded_at_finish,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, nargs="+", default=[10.0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = SpeechTokenizer(TokenizerShape()).to(args.device).eval()
    tokenizer.tokens([speech_like(1.0)])  # warm-up
    rows = [one_turn(tokenizer, signal, s) for signal in SIGNALS for s in args.seconds]
    print(json.dumps({"device": args.device, "threads": args.threads, "turns": rows}, indent=1))


if __name__ == "__main__":
    main()

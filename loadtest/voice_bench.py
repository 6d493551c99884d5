"""Zero-shot voice costs on a local Ray, per transport: registering a clip (encoding it once in the
VoiceBank), pairing a detok replica's endpoint with the bank (the collective group), and fetching a
voice's tensors into a detok codec (bank -> replica over the transport). The real VoiceBank and
DetokVoices; a stand-in codec that only stores what arrives. `--encoders`: instead, each voice
encoder's CPU time per second of clip at the published shapes (random weights), in process.
Usage: python -m loadtest.voice_bench [--voices 6 --clip-s 10 --model cosyvoice2-tiny] [--encoders]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import ray
import torch

from core.config import EngineConfig, ModelConfig, ServeConfig, VoicesConfig
from deployments.voices import NAMESPACE, DetokVoices, bank_name, voice_bank


class HeldVoices:
    """What `DetokVoices.ensure` needs of a codec."""

    def __init__(self) -> None:
        self.voices: dict[str, object] = {}

    def has_voice(self, handle: str) -> bool:
        return handle in self.voices

    def add_voice(self, voice) -> None:
        self.voices[voice.voice_id] = voice


async def fetch_all(side: DetokVoices, voice_ids: list[str]) -> list[float]:
    codec, times = HeldVoices(), []
    for voice_id in voice_ids:
        start = time.perf_counter()
        await side.ensure({voice_id}, codec)
        times.append(time.perf_counter() - start)
    return times


def bench(transport: str, model: str, voices: int, clip_s: float) -> dict:
    config = ServeConfig(
        app_name=f"voice-bench-{transport.replace('_', '-')}", engine=EngineConfig(model=ModelConfig(name=model)),
        voices=VoicesConfig(transport=transport),
    )  # fmt: skip
    bank = voice_bank(config)
    gen = torch.Generator().manual_seed(0)
    register_s, voice_ids = [], []
    for _ in range(voices):
        clip = 0.1 * torch.randn(int(24_000 * clip_s), generator=gen)
        start = time.perf_counter()
        voice_ids.append(ray.get(bank.register.remote(clip, 24_000, "")).voice_id)
        register_s.append(time.perf_counter() - start)
    side = DetokVoices(config, "bench-replica", find_bank=lambda: bank)
    start = time.perf_counter()
    side.join_soon()
    side.joining.result()
    pair_s = time.perf_counter() - start
    fetch_s = asyncio.run(fetch_all(side, voice_ids))
    stats = ray.get(bank.stats.remote())
    ray.kill(ray.get_actor(bank_name(config), namespace=NAMESPACE))
    return {
        "register_first_ms": 1000 * register_s[0], "register_p50_ms": 1000 * statistics.median(register_s[1:]),
        "pair_ms": 1000 * pair_s, "fetch_first_ms": 1000 * fetch_s[0],
        "fetch_p50_ms": 1000 * statistics.median(fetch_s[1:]), "bytes_per_voice": stats["bytes_delivered"] // voices,
    }  # fmt: skip


def encoder_costs(clip_s: float, repeats: int = 3) -> dict[str, float]:
    """ms per second of a 16 kHz clip for each encoder at its published shape (best of `repeats`)."""
    from detok_stage.voice.campplus import CAMPPlus
    from detok_stage.voice.encoder import t3_prompt_tokens
    from detok_stage.voice.s3tokenizer import S3TokenizerV2
    from detok_stage.voice.speaker_lstm import SpeakerLSTM

    torch.manual_seed(0)
    wave = 0.1 * torch.randn(int(16_000 * clip_s))
    tokenizer, campplus, lstm = S3TokenizerV2().eval(), CAMPPlus().eval(), SpeakerLSTM().eval()
    steps = {
        "S3 tokenizer v2 (whole clip)": lambda: tokenizer.tokenize(wave),
        "T3 prompt tokens (first 6 s)": lambda: t3_prompt_tokens(tokenizer, wave),
        "CAM++ x-vector": lambda: campplus.embed(wave),
        "chatterbox voice encoder (LSTM)": lambda: lstm.embed(wave),
    }
    costs = {}
    with torch.inference_mode():
        for name, step in steps.items():
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            costs[name] = 1000 * min(times) / clip_s
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--voices", type=int, default=6)
    parser.add_argument("--clip-s", type=float, default=10.0)
    parser.add_argument("--model", default="cosyvoice2-tiny")
    parser.add_argument("--encoders", action="store_true", help="time each encoder in process, no Ray")
    args = parser.parse_args()
    if args.encoders:
        threads = torch.get_num_threads()
        print(f"| encoder (published shape, {threads} threads) | ms per s of a {args.clip_s:g} s clip |")
        print("|---|---|")
        for name, ms in encoder_costs(args.clip_s).items():
            print(f"| {name} | {ms:.1f} |")
        return
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    print(f"| transport | register {args.clip_s:g} s clip: first / p50 ms | pair ms | fetch: first / p50 ms | bytes |")
    print("|---|---|---|---|---|")
    for transport in ("gloo", "object_store"):
        r = bench(transport, args.model, args.voices, args.clip_s)
        print(f"| {transport} | {r['register_first_ms']:.0f} / {r['register_p50_ms']:.0f} | {r['pair_ms']:.0f} | "
              f"{r['fetch_first_ms']:.1f} / {r['fetch_p50_ms']:.1f} | {r['bytes_per_voice']:,} |")  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()

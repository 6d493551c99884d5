"""What Step-Audio 2's audio encoder costs against an LM decode step, to decide where it runs (issue 39).

Measured on this machine: the tiny preset's encoder over 5 s / 25 s clips (batch 1 and 4) against its
engine's decode step (batch 1 and 8); at the published size, one encoder block over a 25 s piece and
one Qwen2.5-7B decoder layer decoding a token, each scaled to the full stack. Counted for the
published size: FLOPs and weight bytes of the whole encoder per 25 s piece and of one 7B decode step.
Prints one JSON object. Run: `.venv/bin/python -m loadtest.speech_in_bench [--skip-published]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from core.messages import AudioClip
from llm_stage.engine import LLMEngine
from llm_stage.models.clip_audio import clip_wave_16k
from llm_stage.models.step_audio2 import StepAudio2Adapter
from llm_stage.models.step_audio2_encoder import Block, EncoderShape, encode_pieces, num_placeholders, piece_log_mel
from llm_stage.models.step_audio2_lm import qwen_config

PUBLISHED_TEXT = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                  "num_key_value_heads": 4, "vocab_size": 158720}  # fmt: skip
PIECE_S = 25.0


def median_s(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tone_clip(seconds: float) -> AudioClip:
    t = np.arange(int(seconds * 16_000)) / 16_000
    return AudioClip((0.3 * np.sin(2 * np.pi * 200 * t) * 32767).astype("<i2").tobytes(), 16_000)


def tiny_costs(repeats: int) -> dict:
    adapter = StepAudio2Adapter.build(ModelConfig(name="step-audio2-tiny", seed=0))
    model, out = adapter.model, {}
    for seconds in (5.0, 25.0):
        mel = piece_log_mel(clip_wave_16k(tone_clip(seconds)))
        for batch in (1, 4):
            cost = median_s(lambda m=mel, b=batch: encode_pieces(model.encoder, model.adapter, [m] * b), repeats)
            out[f"encode_{seconds:g}s_x{batch}_ms"] = round(1e3 * cost, 2)
        out[f"mel_{seconds:g}s_ms"] = round(1e3 * median_s(lambda s=seconds: piece_log_mel(
            clip_wave_16k(tone_clip(s))), repeats), 2)  # fmt: skip
    for rows in (1, 8):
        out[f"decode_step_x{rows}_ms"] = round(1e3 * tiny_decode_step_s(adapter, rows, repeats), 2)
    return out


def tiny_decode_step_s(adapter: StepAudio2Adapter, rows: int, repeats: int) -> float:
    """The median engine step with `rows` requests decoding (their prompts prefilled before timing)."""
    engine = LLMEngine(adapter, CacheConfig(num_slots=8, max_seq_len=1024), SchedulerConfig(max_batch_size=8), seed=0)
    for i in range(rows):
        engine.add_job(engine.job(f"d{i}", "hello", sampling={"max_tokens": 1000}))
    while engine.scheduler.waiting or any(not r.output_ids for r in engine.requests.values()):
        engine.step()
    cost = median_s(engine.step, repeats)
    for i in range(rows):
        engine.cancel(f"d{i}")
    return cost


def published_counts(shape: EncoderShape = EncoderShape(), text: dict = PUBLISHED_TEXT) -> dict:
    """FLOPs (2 per multiply-add) and bf16 weight bytes: the encoder + adapter over one 25 s piece, and
    one decode step (one token per row) of the 7B LM."""
    d, mels = shape.n_audio_state, int(PIECE_S * 100) + 2
    t2 = (mels + 1) // 2
    pooled = t2 // 2
    rows = num_placeholders(mels, shape)
    per_layer = 2 * t2 * 12 * d * d + 4 * t2 * t2 * d  # projections + MLP, scores + mixing
    convs = 2 * mels * shape.n_mels * d * 3 + 2 * t2 * d * d * 3
    adapter = 2 * rows * (d * d * 3 + d * 2048 + 2048 * shape.llm_dim)
    encoder_flops = shape.n_audio_layer * per_layer + convs + adapter
    encoder_params = shape.n_audio_layer * 12 * d * d + (shape.n_mels + d) * d * 3 + d * d * 3 + d * 2048 \
        + 2048 * shape.llm_dim + shape.n_audio_ctx * d  # fmt: skip
    h, inter, layers, vocab = (text[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    kv = h * text["num_key_value_heads"] // text["num_attention_heads"]
    lm_params = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter) + 2 * vocab * h
    return {
        "encoder_flops_per_25s_piece": encoder_flops, "encoder_bf16_weight_bytes": 2 * encoder_params,
        "placeholders_per_25s_piece": rows, "pooled_frames": pooled,
        "lm_decode_flops_per_row": 2 * lm_params, "lm_bf16_weight_bytes": 2 * lm_params,
    }  # fmt: skip


def published_layer_costs(repeats: int) -> dict:
    """One published-size encoder block over a 25 s piece and one 7B decoder layer decoding one token
    (fp32 on CPU), each times its layer count."""
    shape = EncoderShape()
    block = Block(shape.n_audio_state, shape.n_audio_head).eval()
    x = torch.randn(1, (int(PIECE_S * 100) + 3) // 2, shape.n_audio_state)
    bias = torch.zeros(1, 1, 1, x.shape[1])
    with torch.inference_mode():
        block_s = median_s(lambda: block(x, bias), repeats)
    config: Qwen2Config = qwen_config(PUBLISHED_TEXT)
    config._attn_implementation = "sdpa"
    layer = Qwen2DecoderLayer(config, 0).eval()
    rope = Qwen2RotaryEmbedding(config)
    token = torch.randn(1, 1, config.hidden_size)  # one row, no cache: the weight reads dominate a decode step
    positions = torch.tensor([[300]])
    with torch.inference_mode():
        embeddings = rope(token, positions)
        layer_s = median_s(lambda: layer(token, position_embeddings=embeddings, attention_mask=None), repeats)
    return {
        "encoder_block_25s_ms": round(1e3 * block_s, 1),
        "encoder_25s_ms_scaled": round(1e3 * block_s * shape.n_audio_layer, 0),
        "lm_layer_decode_ms": round(1e3 * layer_s, 2),
        "lm_decode_step_ms_scaled": round(1e3 * layer_s * config.num_hidden_layers, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-published", action="store_true", help="tiny preset and the counts only")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {"threads": torch.get_num_threads(), "tiny": tiny_costs(args.repeats), "published": published_counts()}
    if not args.skip_published:
        result["published_cpu"] = published_layer_costs(max(2, args.repeats // 2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

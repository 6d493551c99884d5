"""Qwen3-TTS against the reference implementation (the `qwen-tts` package, version in golden.json),
without it installed: tests/data/make_qwen3_tts_golden.py wrote a tiny checkpoint with the
reference's own `save_pretrained` and its greedy frames and decoded waveforms. Ours loads that
checkpoint through the published-layout loaders, generates the same frames with the three prompts
batched in the engine (staggered joins), and decodes the same audio, offline and streamed."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import CacheConfig, DetokConfig, ModelConfig, SchedulerConfig
from core.messages import SamplingParams
from detok_stage.codecs.qwen3_tts_codec import Qwen3TTSCodec
from llm_stage.engine import LLMEngine
from llm_stage.models.qwen3_tts import PresetChatTokenizer, Qwen3TTSAdapter, load_qwen3_tts
from tests.detok_stage.interleaved import stream_interleaved

DATA = Path(__file__).resolve().parents[1] / "data" / "qwen3_tts"
CONFIG = ModelConfig(name="qwen3-tts", checkpoint_dir=DATA / "checkpoint")
MAX_FRAMES = 13  # the reference's max_new_tokens=14 yields 13 frames (a frame's codebooks 1.. come a step later)
PENALTY = 1.3  # the script's repetition_penalty


@functools.cache
def golden() -> dict:
    return json.loads((DATA / "golden.json").read_text())


@functools.cache
def golden_audio() -> dict[str, torch.Tensor]:
    with np.load(DATA / "golden_audio.npz") as data:
        return {key: torch.from_numpy(data[key]) for key in data.files}


@functools.cache
def codec() -> Qwen3TTSCodec:
    return Qwen3TTSCodec.build(CONFIG)  # the checkpoint's speech_tokenizer/


def test_golden_data_names_the_reference_and_covers_stops_and_full_length():
    assert golden()["reference"].startswith("qwen-tts ")
    lengths = [len(case["frames"]) for case in golden()["cases"]]
    assert MAX_FRAMES in lengths and min(lengths) < MAX_FRAMES  # some stop on EOS, one runs to the limit


@pytest.mark.parametrize("async_steps", [False, True])
def test_greedy_frames_equal_the_reference_generate(async_steps):
    adapter = Qwen3TTSAdapter(load_qwen3_tts(CONFIG), PresetChatTokenizer())  # prompts from the golden ids
    engine = LLMEngine(
        adapter, CacheConfig(num_slots=3, max_seq_len=64),
        SchedulerConfig(max_batch_size=3, prefill_token_budget=16, async_steps=async_steps),
    )  # fmt: skip
    sampling = SamplingParams(temperature=0.0, repetition_penalty=PENALTY, max_tokens=MAX_FRAMES)
    cases = {f"c{i}": case for i, case in enumerate(golden()["cases"])}
    frames: dict[str, list] = {req_id: [] for req_id in cases}
    for step in range(60):
        for index, (req_id, case) in enumerate(cases.items()):
            if step == 2 * index:
                prefix = adapter.codec_prefix(case["speaker"])
                engine.add_prompt(req_id, adapter.talker_prompt(case["role_ids"], case["text_ids"], prefix), sampling)
        for out in engine.step():
            frames[out.req_id].extend(out.new_frames)
        if step > 4 and not engine.has_work:
            break
    assert frames == {req_id: case["frames"] for req_id, case in cases.items()}


def test_offline_decode_equals_the_reference_waveform():
    codes = torch.tensor([golden()["random_codes"]])
    torch.testing.assert_close(codec().decode(codes)[0], golden_audio()["random"], atol=2e-5, rtol=0)
    for index, case in enumerate(golden()["cases"]):
        audio = codec().decode(torch.tensor([case["frames"]]))[0]
        torch.testing.assert_close(audio, golden_audio()[f"generated_{index}"], atol=2e-5, rtol=0)


def test_streamed_decode_equals_the_reference_waveform():
    frames = {
        "random": torch.tensor(golden()["random_codes"]),
        "generated_0": torch.tensor(golden()["cases"][0]["frames"]),
    }
    got = stream_interleaved(codec(), frames, DetokConfig(first_chunk_frames=1, chunk_frames=3))
    for key, audio in got.items():
        want = (golden_audio()[key].clamp(-1, 1) * 32767).round() / 32767
        torch.testing.assert_close(audio, want, atol=5e-5, rtol=0)

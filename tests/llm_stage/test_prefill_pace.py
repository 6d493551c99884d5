"""The engine measures its prefill pace (llm_stage.prefill_pace): every step that prefilled, by its
positions, and every clip's front end and encode, by its seconds of audio; a speech-in request's
estimated audio positions (`LMAdapter.audio_prompt_positions`) are the positions its prompt takes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core.config import ModelConfig
from core.messages import AudioClip
from llm_stage.models.step_audio2 import NO_CLIP, StepAudio2Adapter
from llm_stage.prefill_pace import PACE_SAMPLES_KEPT, PrefillPace
from tests.factories import adapter_engine


def speech_clip(duration_s: float, sample_rate_hz: int = 24_000) -> AudioClip:
    t = np.arange(round(duration_s * sample_rate_hz)) / sample_rate_hz
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * np.random.default_rng(1).standard_normal(t.size)
    return AudioClip((wave * 32767).astype("<i2").tobytes(), sample_rate_hz)


def test_prefill_pace_counts_positions_beyond_a_decode_step_and_encodes_per_audio_second():
    pace = PrefillPace()
    assert pace.tokens_per_s(0.01) == 0.0 and pace.encoder_s_per_audio_s() == 0.0  # none measured
    pace.record_prefill(0, 5.0)  # a step that prefilled nothing: not a sample
    pace.record_prefill(300, 0.16)  # 300 positions in 0.15 s beyond a 10 ms step
    pace.record_prefill(20, 0.01)  # a short prompt within a step: no extra time, its positions count
    assert pace.tokens_per_s(0.01) == pytest.approx(320 / 0.15)
    assert pace.tokens_per_s(0.2) == 0.0  # every prefill within a step: no figure to charge by
    pace.record_encode(25.0, 1.0)
    pace.record_encode(5.0, 0.5)
    pace.record_encode(0.0, 3.0)  # nothing encoded: not a sample
    assert pace.encoder_s_per_audio_s() == pytest.approx(1.5 / 30.0)
    for _ in range(PACE_SAMPLES_KEPT):
        pace.record_encode(1.0, 0.02)
    assert pace.encoder_s_per_audio_s() == pytest.approx(0.02)  # the recent encodes only
    assert pace.front_end_s_per_audio_s() == 0.0
    pace.record_front_end(25.0, 0.01)
    assert pace.front_end_s_per_audio_s() == pytest.approx(0.01 / 25.0)


@pytest.fixture(scope="module")
def adapter() -> StepAudio2Adapter:
    return StepAudio2Adapter.build(ModelConfig(name="step-audio2-tiny", seed=0))


def test_the_engine_measures_a_speech_in_requests_prefill_and_encode(adapter):
    engine = adapter_engine(adapter, num_slots=2, max_seq_len=1024)  # a 64-position prefill budget
    clip = speech_clip(3.0)
    job = engine.job("q", "What is this?", sampling={"temperature": 0.0, "max_tokens": 4})
    engine.add_job(dataclasses.replace(job, audio=clip, text_only=True))
    prompt = engine.requests["q"].prompt_ids
    engine.run_to_completion()
    pace = engine.prefill_pace
    # every prompt position prefilled was counted, over the steps the budget spread it across
    assert sum(n for n, _ in pace._prefills) == len(prompt) and len(pace._prefills) > 1
    assert pace.tokens_per_s(0.0) > 0
    (audio_s, encode_s), *rest = pace._encodes  # one encode: 3 s of audio (10 ms per log-mel frame)
    assert not rest and audio_s == pytest.approx(3.0, abs=0.05) and encode_s > 0
    assert pace.encoder_s_per_audio_s() == pytest.approx(encode_s / audio_s)
    (clip_s, front_end_s), *rest = pace._front_ends  # its log-mel, computed at its add (no features came)
    assert not rest and clip_s == pytest.approx(3.0)
    assert pace.front_end_s_per_audio_s() == pytest.approx(front_end_s / 3.0)


def test_the_estimated_audio_positions_are_the_prompts(adapter):
    """The Router charges a clip's positions before any replica encodes it: the family's figure is
    exactly the placeholders and markers its prompt gets (any rate, pieces of 25 s)."""
    engine = adapter_engine(adapter, num_slots=2, max_seq_len=2048)
    for index, (duration_s, rate_hz) in enumerate(((0.7, 16_000), (3.0, 24_000), (27.5, 48_000))):
        req_id = f"c{index}"
        job = dataclasses.replace(engine.job(req_id, "Hi."), audio=speech_clip(duration_s, rate_hz))
        engine.add_job(job)
        prompt = engine.requests[req_id].prompt_ids
        placeholders = sum(1 for position in prompt if position[1] != NO_CLIP)
        pieces = -(-duration_s // 25.0)  # an <audio_start> and <audio_end> per 25 s piece
        assert StepAudio2Adapter.audio_prompt_positions(job.audio.duration_s) == placeholders + 2 * pieces
        engine.cancel(req_id)

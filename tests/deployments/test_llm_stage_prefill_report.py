"""The LLM replica's load report carries its measured prefill pace after a speech-in request ran (prompt
positions per second beyond a decode step, encoder seconds per audio second), and its admission
charges a request's own prompt work at it. In-process: the stage's helpers over a real engine, no Ray."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core.config import EngineConfig, ModelConfig, ServeConfig
from core.messages import AudioClip
from deployments.llm_stage import LLMStage
from llm_stage.jobs import build_job
from llm_stage.wiring import build_llm_side
from router.admission import StartTimes, first_chunk_s, predict_ttfa_s, start_to_first_output_s


def clip(duration_s: float) -> AudioClip:
    t = np.arange(round(duration_s * 16_000)) / 16_000
    return AudioClip((0.3 * np.sin(2 * np.pi * 200 * t) * 32767).astype("<i2").tobytes(), 16_000)


def speech_in_stage() -> LLMStage:
    """An LLMStage's reporting state over a step-audio2-tiny engine (no detok replicas, no Serve)."""
    stage = object.__new__(LLMStage)
    stage.config = ServeConfig(engine=EngineConfig(model=ModelConfig(name="step-audio2-tiny", torch_threads=1)))
    stage.side = build_llm_side(stage.config.engine)
    stage.schedule, stage.rows_per_stream, stage.detok_scope = stage.side.schedule, 1, "no-detok-here"
    stage.streams, stage.is_moving_out, stage.avg_stream_s, stage.start_times = {}, False, 0.0, StartTimes()
    return stage


def test_the_load_report_carries_the_prefill_pace_measured_by_a_speech_in_request():
    stage = speech_in_stage()
    before = stage.load()
    assert before.prefill_tokens_per_s == 0.0 and before.encoder_s_per_audio_s == 0.0  # nothing measured yet
    job = build_job(stage.side.engine.adapter, text="", audio=clip(4.0), text_only=True, req_id="q",
                    sampling={"temperature": 0.0, "max_tokens": 6})  # fmt: skip
    stage.side.add(job)
    while stage.side.engine.has_work:
        stage.side.step()
    engine = stage.side.engine
    engine.timer._decode_step_s = 0.0  # (the steady step: each prefill step's time is then all prefill)
    load = stage.load()
    positions, elapsed_s = (sum(column) for column in zip(*engine.prefill_pace._prefills, strict=True))
    assert load.prefill_tokens_per_s == pytest.approx(positions / elapsed_s) and load.prefill_tokens_per_s > 0
    (audio_s, encode_s), *_ = engine.prefill_pace._encodes
    assert load.encoder_s_per_audio_s == pytest.approx(encode_s / audio_s) and audio_s == pytest.approx(4.0, abs=0.05)
    (clip_s, front_end_s), *_ = engine.prefill_pace._front_ends  # its log-mel, computed here at its add
    assert load.front_end_s_per_audio_s == pytest.approx(front_end_s / 4.0) and clip_s == pytest.approx(4.0)
    budget = load.prefill_token_budget
    assert budget == stage.config.engine.scheduler.prefill_token_budget
    # the replica's own admission charges the next clip's work at those figures (its start-by too)
    work = stage._prompt_work(dataclasses.replace(job, req_id="next", audio=clip(20.0), text_only=False))
    assert work.audio_s == work.front_end_audio_s == pytest.approx(20.0) and work.num_positions > budget
    more_steps = -(-work.num_positions // budget) - 1  # its prompt spans that many steps past the first
    own_s = (work.num_positions / load.prefill_tokens_per_s + 20.0 * load.encoder_s_per_audio_s
             + 20.0 * load.front_end_s_per_audio_s + more_steps * (load.next_step_s or load.step_s))  # fmt: skip
    assert predict_ttfa_s(load, work=work) == pytest.approx(predict_ttfa_s(load) + own_s)
    assert start_to_first_output_s(load, work) == pytest.approx(first_chunk_s(load) + own_s)



def test_the_load_report_counts_the_prompt_positions_waiting_to_prefill():
    stage = speech_in_stage()
    assert stage.load().queued_prefill_positions == 0
    job = build_job(stage.side.engine.adapter, text="", audio=clip(4.0), text_only=True, req_id="q",
                    sampling={"temperature": 0.0, "max_tokens": 6})  # fmt: skip
    stage.side.add(job)
    request = stage.side.engine.requests["q"]
    assert stage.load().queued_prefill_positions == request.prompt_len > 50  # its clip's placeholders
    while stage.side.engine.has_work:
        stage.side.step()
    assert stage.load().queued_prefill_positions == 0

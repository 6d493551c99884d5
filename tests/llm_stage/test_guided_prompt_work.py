"""A guided request (CFG) prefills its hidden twin's prompt beside its own, and the replica's prefill pace
divides the time by both rows' positions: admission charges a guided request both prompts (Dia's zero text
and Chatterbox's unconditional text are as long as the guided prompt; parallel heads' twin is two
positions), an unguided one its own. Real tiny engines, no Ray."""

from __future__ import annotations

import pytest

from core.config import EngineConfig, ModelConfig
from llm_stage.jobs import build_job
from llm_stage.prompt_work import prompt_work
from llm_stage.wiring import build_llm_side

TEXT = "Good morning, and welcome aboard the early train."


def engine_of(model: str):
    return build_llm_side(EngineConfig(model=ModelConfig(name=model, torch_threads=1))).engine


@pytest.mark.parametrize("model", ["dia-tiny", "chatterbox-tiny", "parallel-heads-tiny"])
def test_a_guided_job_is_charged_its_twins_prompt_and_the_pace_counts_both_rows(model):
    engine = engine_of(model)
    adapter, lm = engine.adapter, type(engine.adapter)
    guided = build_job(adapter, text=TEXT, sampling={"guidance_scale": 3.0, "max_tokens": 4}, req_id="g")
    unguided = build_job(adapter, text=TEXT, sampling={"guidance_scale": None, "max_tokens": 4}, req_id="u")
    own, twin = adapter.job_prompt(guided), adapter.unconditional_job_prompt(guided)
    assert lm.twin_prompt_positions(len(own)) == len(twin)  # the twin's length as the family builds it
    estimate = lm.estimate_prompt_positions(guided)
    assert prompt_work(lm, unguided).num_positions == estimate
    assert prompt_work(lm, guided).num_positions == estimate + lm.twin_prompt_positions(estimate)
    # the engine prefills both rows, and the pace admission charges at is per position of both
    engine.add_job(guided)
    for _ in range(64):  # to its end: every prefill step of the pair recorded
        if not engine.scheduler.has_work:
            break
        engine.step()
    assert not engine.scheduler.has_work
    recorded = sum(positions for positions, _ in engine.prefill_pace._prefills)
    assert recorded == len(own) + len(twin)

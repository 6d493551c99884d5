"""The start-up warm-up at the largest shapes (`llm_stage.warm_up`): it runs every batch row and the
longest prompt, and a stream served after it is the stream a fresh engine serves."""

from __future__ import annotations

import pytest

from core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llm_stage.registry import model_names
from llm_stage.warm_up import FULL_STEPS, warm_up
from llm_stage.wiring import build_llm_side

PRESETS = [name for name in model_names() if name.endswith("-tiny")]


def engine_for(name: str, layout: str = "slot", rows: int = 4):
    cache = CacheConfig(num_slots=rows, max_seq_len=512, layout=layout)
    config = EngineConfig(model=ModelConfig(name=name), cache=cache, scheduler=SchedulerConfig(max_batch_size=rows))
    return build_llm_side(config).engine


def tokens_of_two_streams(engine) -> dict[str, list]:
    """A seeded stream and one seeded by the engine's own seed source, side by side."""
    engine.add_request("seeded", "Hello there, how are you today?", sampling={"seed": 7, "max_tokens": 40})
    engine.add_request("unseeded", "A second voice speaks.", sampling={"max_tokens": 40})
    return engine.run_to_completion()


@pytest.mark.parametrize("name", PRESETS)
def test_a_warmed_engine_serves_what_a_fresh_one_serves_and_is_left_idle(name):
    fresh, warmed = engine_for(name), engine_for(name)
    report = warm_up(warmed)
    assert report.rows == 4 and report.steps > 0
    assert not warmed.requests and not warmed.has_work
    assert warmed.scheduler.slots.num_used == 0
    assert warmed.timer.measured_step_s == 0.0 and not warmed.timer.step_s_by_rows  # admission meets the prior
    assert tokens_of_two_streams(warmed) == tokens_of_two_streams(fresh)


def test_the_warm_up_fills_every_row_and_prefills_past_the_prompt_budget():
    engine = engine_for("orpheus-tiny", rows=6)
    report = warm_up(engine)
    assert report.requests == 6 and report.rows == 6
    assert report.full_steps == FULL_STEPS  # every row decoding at once
    assert report.longest_prompt > engine.scheduler.config.prefill_token_budget  # chunked prefill, the longest text
    assert report.longest_prompt < engine.cache_config.max_seq_len


def test_a_guided_family_warms_up_two_rows_per_stream():
    report = warm_up(engine_for("dia-tiny", rows=5))
    assert (report.requests, report.rows) == (2, 4)  # a third stream's twin would need a sixth row


def test_the_paged_cache_is_whole_again_after_the_warm_up():
    engine = engine_for("orpheus-tiny", layout="paged")
    free = engine.scheduler.blocks.num_free
    warm_up(engine)
    assert engine.scheduler.blocks.num_free == free and engine.scheduler.slots.num_used == 0

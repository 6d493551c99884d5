"""Every family's decode forward is what a CUDA graph can capture: run on CPU tensors as the captured
graph runs it (padded to a captured size, attention at the graph's static length), no op waits for the
device (`tests.graph_capture`), for each tiny preset whose backbone is wired for decode graphs; the one
that is not (Dia's encoder-decoder) says so. On CUDA a host-waiting op fails the capture, and the
family would decode eagerly, launch-bound (issue 36's figures: 52-110 ms a step eager, 6-13 with graphs)."""

from __future__ import annotations

import dataclasses

import pytest

import llm_stage.attention as attention
from core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llm_stage.decode_graphs import DecodeGraphs
from llm_stage.registry import get_entry, model_names
from llm_stage.wiring import build_llm_side
from tests.graph_capture import OpNames
from tests.llm_stage.test_step_audio2 import tone_clip

PRESETS = [name for name in model_names() if name.endswith("-tiny")]
EAGER_ONLY = {"dia-tiny"}  # DiaDecoder: `supports_decode_graphs = False` (cross-attention to its encoder)


def decoding_engine(name: str):
    """Three streams of `name` past their prompts, every row decoding."""
    config = EngineConfig(model=ModelConfig(name=name), cache=CacheConfig(num_slots=6, max_seq_len=512),
                          scheduler=SchedulerConfig(max_batch_size=6))  # fmt: skip
    engine = build_llm_side(config).engine
    for i in range(3):
        job = engine.job(f"r{i}", f"Request number {i} speaks.", sampling={"seed": i, "max_tokens": 60})
        if engine.adapter.takes_audio:
            job = dataclasses.replace(job, audio=tone_clip(8_000 + 3_000 * i, seed=i))
        engine.add_job(job)
    while engine.scheduler.waiting or any(r.num_cached < len(r.prompt_ids) for r in engine.requests.values()):
        engine.step()
    return engine


@pytest.mark.parametrize("name", PRESETS)
def test_the_decode_forward_waits_for_no_device_value(name, monkeypatch):
    monkeypatch.setattr(attention, "_capturing", lambda device: True)
    engine = decoding_engine(name)
    runner = engine.runner
    if name in EAGER_ONLY:
        assert not runner.backbone.supports_decode_graphs
        return
    assert runner.backbone.supports_decode_graphs, f"{name}: decode graphs not wired"
    plan = engine.scheduler.schedule()
    assert plan.decodes and not plan.prefills
    runner.graphs = DecodeGraphs(runner._decode_forward, (8,), runner.padding_row, runner.device)
    batch = runner.prepare(plan).decode
    assert batch.input_ids.shape[0] == 8  # padded to the captured size
    with OpNames() as ops:
        runner.graphs.run_static(batch)
    assert not ops.host_waiting, f"{name}: {sorted(ops.host_waiting)}"


def test_every_tiny_preset_is_checked():
    assert {get_entry(name).family.name for name in PRESETS} == {get_entry(n).family.name for n in model_names()}

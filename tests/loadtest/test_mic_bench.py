"""loadtest.mic_bench on a short turn: every figure it reports is there and positive (no timing is
asserted: the figures go to the speech-in diary)."""

from __future__ import annotations

from core.config import ModelConfig
from llm_stage.models.step_audio2 import StepAudio2Adapter
from loadtest.mic_bench import turn_costs


def test_a_short_turn_reports_every_figure() -> None:
    adapter = StepAudio2Adapter.build(ModelConfig(name="step-audio2-tiny", seed=0))
    costs = turn_costs(0.5, 24_000, 1, adapter)
    assert set(costs) == {"piece_median_ms", "piece_max_ms", "streamed_total_ms", "finish_at_end_of_turn_ms",
                          "whole_clip_front_end_ms", "published_front_end_ms", "tiny_encoder_ms"}  # fmt: skip
    assert all(value > 0 for value in costs.values())

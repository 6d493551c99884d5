"""LLMSide tells the streaming policy how long each stream can be left out of the batch."""

from __future__ import annotations

from types import SimpleNamespace

from core.config import DetokConfig
from core.messages import SamplingParams
from core.policy import StepTimer, slack_s
from llm_stage.chunking import Chunker, ChunkSchedule
from llm_stage.engine import StepOutput
from llm_stage.request import Request
from llm_stage.side import LLMSide

FRAME = [0] * 7


class OneRequestEngine:
    """The engine surface LLMSide reads: `step`, `requests`, `timer`, `adapter.steps_per_frame`."""

    def __init__(self, req: Request) -> None:
        self.requests = {req.req_id: req}
        self.timer = StepTimer(step_s=0.01, detok_s=0.05, steps_per_frame=7)
        self.adapter = SimpleNamespace(steps_per_frame=7)
        self.frames_next_step = 0

    def step(self) -> list[StepOutput]:
        frames, self.frames_next_step = [FRAME] * self.frames_next_step, 0
        return [StepOutput("r", [0], frames)]


def test_slack_is_measured_on_the_smallest_next_chunk_not_the_planned_one():
    req = Request("r", [1, 2], SamplingParams())
    engine = OneRequestEngine(req)
    now = 100.0
    side = LLMSide(engine, ChunkSchedule.from_config(DetokConfig(first_chunk_frames=4)), clock=lambda: now)
    chunker = side.chunkers["r"] = Chunker("r", side.schedule)
    engine.frames_next_step = 7  # the first chunk: 4 frames kept, 3 of right context
    assert len(side.step()) == 1
    req.first_audio_s, req.audio_sent_s = 99.0, 1.6  # 0.6 s buffered at the client
    side.step()
    # From this buffer LLMSide plans a 5-frame chunk (35 tokens: 0.35 s + 0.05 s detok), which would
    # leave 0.2 s of slack, under the urgency threshold; left out of the batch, the stream cuts a
    # 1-frame chunk instead, 7 tokens away: it can wait 0.48 s.
    assert chunker.frames_to_next_chunk(side._frame_budget(req)) == 5
    assert req.tokens_to_next_chunk == 7
    assert abs(slack_s(req, now, engine.timer) - (0.6 - 7 * 0.01 - 0.05)) < 1e-9


def test_streams_whose_buffer_is_spent_count_as_starving():
    req = Request("r", [1, 2], SamplingParams())
    now = 100.0
    side = LLMSide(OneRequestEngine(req), ChunkSchedule.from_config(DetokConfig()), clock=lambda: now)
    assert side.num_starving() == 0  # no audio yet: starting, not starving
    req.first_audio_s, req.audio_sent_s = 99.0, 1.5
    assert side.num_starving() == 0  # 0.5 s still buffered
    req.audio_sent_s = 0.8
    assert side.num_starving() == 1  # played past what it was sent


def test_a_later_segment_of_a_playing_stream_takes_over_its_playback_clock():
    import dataclasses

    import pytest

    from core.config import EngineConfig, ModelConfig
    from core.policy import buffered_s
    from llm_stage.jobs import build_job
    from llm_stage.wiring import build_llm_side

    side = build_llm_side(EngineConfig(model=ModelConfig(name="orpheus-tiny")))
    adapter = side.engine.adapter
    side.add(build_job(adapter, text="First.", req_id="s.0"))
    later = build_job(adapter, text="Second.", req_id="s.1")
    side.add(dataclasses.replace(later, segment_index=1, buffered_audio_s=0.8))
    assert side.engine.requests["s.0"].first_audio_s is None  # a new stream: startup phase
    assert buffered_s(side.engine.requests["s.1"], side.clock()) == pytest.approx(0.8, abs=0.05)  # steady, 0.8 s left

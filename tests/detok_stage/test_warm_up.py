"""The detokenizer's start-up warm-up (`detok_stage.warm_up`): one batch of the longest windows,
after which a stream decodes to the audio a fresh engine gives, byte for byte."""

from __future__ import annotations

import random

import pytest

from core.config import DetokConfig, EngineConfig, ModelConfig
from detok_stage.warm_up import warm_up, warm_up_chunks
from llm_stage.chunking import Chunker, ChunkSchedule
from llm_stage.registry import check_engine_config, model_names
from llm_stage.wiring import build_detok_engine

PRESETS = [name for name in model_names() if name.endswith("-tiny")]


def config_for(name: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(name=name), detok=DetokConfig(max_batch_chunks=4))


def stream_pcm(engine, schedule: ChunkSchedule, num_frames: int = 40) -> bytes:
    rng = random.Random(5)
    frames = [[rng.randrange(8) for _ in range(engine.codec.codes_per_frame)] for _ in range(num_frames)]
    chunker = Chunker("stream", schedule)
    for chunk in chunker.push(frames) + chunker.finish():
        engine.submit(chunk)
    pcm = []
    while engine.has_work:
        pcm += [out.pcm16 for out in sorted(engine.step(), key=lambda out: out.seq)]
    return b"".join(pcm)


@pytest.mark.parametrize("name", PRESETS)
def test_a_warmed_detokenizer_decodes_what_a_fresh_one_decodes(name):
    config = config_for(name)
    schedule = check_engine_config(config).chunk_schedule(config)
    fresh, warmed = build_detok_engine(config), build_detok_engine(config)
    report = warm_up(warmed, schedule.longest_window())
    assert report.chunks == 4 and report.steps >= 1
    assert warmed.num_decoded_frames == 0 and warmed.num_requests == 0 and not warmed.has_work
    assert stream_pcm(warmed, schedule) == stream_pcm(fresh, schedule)


def test_the_warm_up_windows_are_the_longest_the_schedule_cuts():
    schedule = ChunkSchedule(first_chunk_frames=4, chunk_frames=8, left_context_frames=3, right_context_frames=3)
    assert schedule.longest_window() == (3, 8, 3)
    chunks = warm_up_chunks(schedule.longest_window(), 2, codes_per_frame=7)
    assert [c.num_frames for c in chunks] == [14, 14] and len(chunks[0].frames[0]) == 7
    assert (chunks[0].keep_start, chunks[0].keep_end) == (3, 11) and chunks[0].is_final
    whole_stream = ChunkSchedule(25, 25, 131072, 3)  # a stateful detokenizer's history: capped at two chunks
    assert whole_stream.longest_window() == (50, 25, 3)

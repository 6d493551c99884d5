"""CUDA-graph paths off-GPU: what a graph would replay (padded to a captured size) equals the
eager forward, and asking for graphs on a CPU falls back to eager with a warning. Capture and
replay themselves only run on a CUDA device (see BENCHMARKS "GPU")."""

from __future__ import annotations

import logging

import pytest
import torch

from core.config import DetokConfig, ModelConfig
from core.graphs import GraphCache
from detok_stage.codecs.snac_codec import SnacCodec
from detok_stage.engine import DetokEngine
from detok_stage.graphs import ChunkGraphs
from llm_stage.decode_graphs import DecodeGraphs
from tests.factories import orpheus_engine


def decoding_engine():
    engine = orpheus_engine(num_slots=6)
    for i, text in enumerate(["one", "a second request", "three three three"]):
        engine.add_request(f"r{i}", text, None, {"max_tokens": 40, "seed": i})
    for _ in range(9):  # prompts in, a few tokens decoded
        engine.step()
    return engine


def test_padded_decode_equals_eager_and_writes_only_real_and_scratch_slots():
    engine = decoding_engine()
    runner, cache = engine.runner, engine.runner.cache
    plan = engine.scheduler.schedule()
    assert len(plan.decodes) == 3 and not plan.prefills
    eager_batch = runner.prepare(plan).decode
    runner.graphs = DecodeGraphs(runner._decode_forward, [2, 4, 8], runner.padding_row, runner.device)
    step = runner.prepare(plan)  # padded on the host to the captured size 4
    padded = step.decode
    assert step.num_decodes == 3 and padded.input_ids.shape[0] == 4
    assert int(padded.slots[3]) == cache.scratch_slot and int(padded.positions[3, 0]) == 0
    untouched = [s for s in range(cache.scratch_slot) if s not in {r.slot for r in plan.decodes}]
    before = cache.keys[:, untouched].clone()
    static = runner.graphs.run_static(padded)[:3]
    eager = runner._forward(eager_batch)
    torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.keys[:, untouched], before)
    torch.testing.assert_close(runner.forward(step), eager, atol=1e-5, rtol=1e-5)  # no graph here: eager, cut to 3
    runner.graphs = DecodeGraphs(runner._decode_forward, [2], runner.padding_row, runner.device)
    assert runner.graphs.size_for(3) is None and runner.prepare(plan).decode.input_ids.shape[0] == 3  # eager


def test_graph_cache_does_not_capture_off_cuda():
    cache = GraphCache(lambda x: x * 2, "double")
    x = torch.ones(3)
    assert cache.capture([x]) is False and cache(x) is None and cache.num_captured == 0


def test_llm_graphs_requested_on_cpu_run_eagerly_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        graphed = orpheus_engine(num_slots=2, cuda_graph_batch_sizes=(1, 2))
    assert graphed.runner.graphs is None
    assert "CUDA graphs requested on cpu" in caplog.text
    plain = orpheus_engine(num_slots=2)
    for engine in (graphed, plain):
        engine.add_request("g", "same words", None, {"temperature": 0.0, "max_tokens": 14})
    assert graphed.run_to_completion() == plain.run_to_completion()


def test_detok_graph_padding_and_cpu_fallback(caplog):
    codec = SnacCodec.build(ModelConfig())
    config = DetokConfig(cuda_graph_batch_sizes=(2, 4))
    with caplog.at_level(logging.WARNING):
        engine = DetokEngine(codec, config)
    assert engine.graphs is None and "detokenizer decodes eagerly" in caplog.text
    graphs = ChunkGraphs(codec, 14, [2, 4], "cpu")
    frames = torch.randint(0, 4096, (3, 14, 7))
    padded = graphs.pad(frames)
    assert padded.shape == (4, 14, 7) and torch.equal(padded[3], frames[0])
    short = torch.randint(0, 4096, (3, 9, 7))  # a shorter window (a first chunk, a stream's end): its own graphs
    assert graphs.pad(short).shape == (4, 9, 7)
    assert graphs.pad(torch.randint(0, 4096, (3, 15, 7))) is None  # longer than the schedule's windows: eager
    assert graphs.pad(torch.randint(0, 4096, (5, 14, 7))) is None  # more chunks than captured: eager
    assert graphs.run(frames) is None  # nothing captured on a CPU
    torch.testing.assert_close(codec.decode(padded)[:3], codec.decode(frames), atol=1e-5, rtol=0)


@pytest.mark.parametrize("frames", [1, 5])
def test_snac_levels_by_slicing_match_the_frame_layout(frames):
    codes = torch.arange(frames * 7).view(1, frames, 7)
    level0, level1, level2 = SnacCodec.frames_to_levels(codes)
    assert level0.tolist() == [[7 * f for f in range(frames)]]
    assert level1.tolist() == [[7 * f + i for f in range(frames) for i in (1, 4)]]
    assert level2.tolist() == [[7 * f + i for f in range(frames) for i in (2, 3, 5, 6)]]

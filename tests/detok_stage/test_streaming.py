"""Streamed audio vs offline decoding, for both chunk schedules, with many requests batched."""

from __future__ import annotations

import functools

import pytest
import torch

from core.config import DetokConfig, ModelConfig, SchedulerConfig
from core.errors import InvalidArgumentError
from core.messages import TokenChunk
from core.policy import make_policy
from detok_stage.codecs.snac_codec import SnacCodec
from detok_stage.engine import DetokEngine, pcm16_to_float
from llm_stage.chunking import Chunker, ChunkSchedule

SPF = 2048


@functools.cache
def codec() -> SnacCodec:
    return SnacCodec.build(ModelConfig())


def stream(config: DetokConfig, streams: dict[str, torch.Tensor], push_sizes=(1, 3, 2)) -> dict[str, torch.Tensor]:
    """Feed each stream's frames a few at a time through Chunkers into one DetokEngine."""
    engine = DetokEngine(codec(), config)
    chunkers = {rid: Chunker(rid, ChunkSchedule.from_config(config)) for rid in streams}
    cursor = dict.fromkeys(streams, 0)
    audio: dict[str, list[bytes]] = {rid: [] for rid in streams}
    finals = set()
    for tick in range(10_000):
        for rid, frames in streams.items():
            if rid not in chunkers:
                continue
            size = push_sizes[tick % len(push_sizes)]
            new = frames[cursor[rid] : cursor[rid] + size].tolist()
            cursor[rid] += size
            chunks = chunkers[rid].push(new)
            if cursor[rid] >= len(frames):
                chunks += chunkers.pop(rid).finish()
            for chunk in chunks:
                engine.submit(chunk)
        for out in engine.step():
            audio[out.req_id].append(out.pcm16)
            if out.is_final:
                finals.add(out.req_id)
        if not chunkers and not engine.has_work:
            break
    assert finals == set(streams)
    return {rid: torch.from_numpy(pcm16_to_float(b"".join(parts))) for rid, parts in audio.items()}


def random_streams(lengths: list[int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {f"r{i}": torch.randint(0, 4096, (n, 7), generator=gen) for i, n in enumerate(lengths)}


def quantized(wave: torch.Tensor) -> torch.Tensor:
    return (wave.clamp(-1, 1) * 32767).round() / 32767


@pytest.mark.parametrize("async_steps", [False, True])
def test_wide_schedule_equals_full_offline_decode(async_steps):
    """With context >= SNAC's receptive field (3 frames each side), chunked decoding is exact
    (also when each window-length group decodes on the worker thread: `async_steps`)."""
    streams = random_streams([1, 5, 23, 40])
    got = stream(DetokConfig(schedule="wide", first_chunk_frames=2, chunk_frames=8, async_steps=async_steps), streams)
    for rid, frames in streams.items():
        offline = codec().decode(frames.unsqueeze(0))[0]
        assert got[rid].shape[0] == len(frames) * SPF
        torch.testing.assert_close(got[rid], quantized(offline), atol=2e-4, rtol=0)


def test_reference_schedule_equals_offline_decode_of_its_windows():
    """Orpheus' semantics: each frame is decoded in a 4-frame window (1 left, 2 right) and kept."""
    streams = random_streams([2, 9, 17])
    got = stream(DetokConfig(schedule="reference"), streams)
    for rid, frames in streams.items():
        n = len(frames)
        expected = []
        for j in range(n):
            lo, hi = max(0, j - 1), min(n, j + 3)
            window = codec().decode(frames[lo:hi].unsqueeze(0))[0]
            expected.append(window[(j - lo) * SPF : (j - lo + 1) * SPF])
        assert got[rid].shape[0] == n * SPF
        torch.testing.assert_close(got[rid], quantized(torch.cat(expected)), atol=2e-4, rtol=0)


def test_wide_schedule_decodes_fewer_frames_than_reference():
    frames = random_streams([40])["r0"].tolist()
    decoded = {}
    for schedule in ("reference", "wide"):
        config = DetokConfig(schedule=schedule)
        engine = DetokEngine(codec(), config)
        chunker = Chunker("r", ChunkSchedule.from_config(config))
        for chunk in chunker.push(frames) + chunker.finish():
            engine.submit(chunk)
        while engine.has_work:
            engine.step()
        decoded[schedule] = engine.num_decoded_frames
    assert decoded["reference"] > 3 * 40 and decoded["wide"] < 2 * 40


def test_bad_codes_rejected_with_field():
    engine = DetokEngine(codec(), DetokConfig())
    with pytest.raises(InvalidArgumentError) as err:
        engine.submit(TokenChunk("r", 0, [[0, 1, 2, 3, 4, 5, 4096]], 0, 0, 1, True))
    assert err.value.field == "frames"
    with pytest.raises(InvalidArgumentError):
        engine.submit(TokenChunk("r", 0, [[0, 1, 2]], 0, 0, 1, True))


def test_chunker_first_chunk_small_then_steady():
    chunker = Chunker(
        "r", ChunkSchedule(first_chunk_frames=2, chunk_frames=4, left_context_frames=1, right_context_frames=1)
    )
    chunks = chunker.push([[0] * 7] * 12)
    assert [(c.keep_start, c.keep_end, c.window_start, c.num_frames) for c in chunks] == [
        (0, 2, 0, 3),
        (2, 6, 1, 6),
        (6, 10, 5, 6),
    ]
    final = chunker.finish()
    assert [(c.keep_start, c.keep_end, c.window_start, c.is_final) for c in final] == [(10, 12, 9, True)]


def test_release_drops_pending_chunks():
    engine = DetokEngine(codec(), DetokConfig())
    engine.submit(TokenChunk("gone", 0, [[1] * 7] * 3, 0, 0, 1, False))
    engine.release("gone")
    assert not engine.has_work and engine.num_requests == 0


def test_adaptive_chunks_double_up_to_steady_size_and_respect_frame_budget():
    schedule = ChunkSchedule(
        first_chunk_frames=2, chunk_frames=8, left_context_frames=0, right_context_frames=0, adaptive=True
    )
    chunker = Chunker("r", schedule)
    sizes = [c.keep_end - c.keep_start for c in chunker.push([[0] * 7] * 30)]
    assert sizes == [2, 4, 8, 8, 8]
    tight = Chunker("r", schedule)
    sizes = [c.keep_end - c.keep_start for c in tight.push([[0] * 7] * 10, frame_budget=3)]
    assert sizes == [2, 3, 3]  # the first chunk keeps its size; later ones wait for at most 3 frames


def test_a_spent_buffer_restarts_at_the_first_chunk_size_not_one_frame():
    """An empty client buffer (budget <= 0) gets first-chunk-sized chunks: one-frame chunks would
    decode 7 frames (3 + 1 + 3 with context) per frame kept and starve every stream under load."""
    schedule = ChunkSchedule(
        first_chunk_frames=4, chunk_frames=16, left_context_frames=3, right_context_frames=3, adaptive=True
    )
    spent = Chunker("r", schedule)
    sizes = [c.keep_end - c.keep_start for c in spent.push([[0] * 7] * 30, frame_budget=0)]
    assert sizes[1:] == [4] * (len(sizes) - 1) and sizes[0] == 4
    low = Chunker("r", schedule)
    assert [c.keep_end - c.keep_start for c in low.push([[0] * 7] * 12, frame_budget=2)][1:3] == [2, 2]


def test_smallest_next_chunk_is_one_frame_after_the_first_for_adaptive_schedules():
    adaptive = ChunkSchedule(
        first_chunk_frames=4, chunk_frames=8, left_context_frames=3, right_context_frames=3, adaptive=True
    )
    chunker = Chunker("r", adaptive)
    assert chunker.frames_to_smallest_next_chunk() == 7  # the first chunk keeps its size: 4 + 3 right context
    assert len(chunker.push([[0] * 7] * 7)) == 1
    assert chunker.frames_to_next_chunk() == 8  # a full 8-frame chunk: 4 + 8 + 3 - 7 frames known
    assert chunker.frames_to_smallest_next_chunk() == 1  # a 1-frame chunk only needs one more frame
    fixed = Chunker("r", ChunkSchedule(4, 8, 3, 3, adaptive=False))
    fixed.push([[0] * 7] * 7)
    assert fixed.frames_to_smallest_next_chunk() == fixed.frames_to_next_chunk() == 8  # sizes never shrink


def test_adaptive_wide_schedule_still_equals_offline_decode():
    streams = random_streams([37])
    config = DetokConfig(schedule="wide", first_chunk_frames=1, chunk_frames=16, adaptive=True)
    got = stream(config, streams)
    offline = codec().decode(streams["r0"].unsqueeze(0))[0]
    torch.testing.assert_close(got["r0"], quantized(offline), atol=2e-4, rtol=0)


def test_throughput_mode_uses_long_chunks_and_stays_exact():
    config = DetokConfig(throughput_chunk_frames=16)
    streaming = make_policy(SchedulerConfig(policy="streaming"))
    schedule = ChunkSchedule.for_policy(config, make_policy(SchedulerConfig(policy="throughput")))
    assert (schedule.first_chunk_frames, schedule.chunk_frames, schedule.adaptive) == (16, 16, False)
    assert schedule.decode_factor < ChunkSchedule.for_policy(config, streaming).decode_factor
    assert ChunkSchedule.for_policy(config, streaming) == ChunkSchedule.from_config(config)
    frames = random_streams([40])["r0"]
    engine, chunker = DetokEngine(codec(), config), Chunker("r", schedule)
    for chunk in chunker.push(frames.tolist()) + chunker.finish():
        engine.submit(chunk)
    pcm = b"".join(out.pcm16 for _ in range(10) for out in engine.step())
    offline = codec().decode(frames.unsqueeze(0))[0]
    torch.testing.assert_close(torch.from_numpy(pcm16_to_float(pcm)), quantized(offline), atol=2e-4, rtol=0)

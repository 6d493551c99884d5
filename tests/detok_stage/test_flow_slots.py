"""The S3Gen flow's pooled streaming state: one forward per Euler step whatever the batch, slots and
blocks given back when a stream's state is dropped, pools that grow without losing what they hold."""

from __future__ import annotations

import gc

import pytest
import torch

from detok_stage.codecs.s3gen_codec import S3GenCodec
from detok_stage.flow.config import tiny_s3gen_config
from detok_stage.flow.model import S3Gen
from detok_stage.flow.slots import (
    BLOCK_POSITIONS,
    DROPPED,
    STEPS,
    TOKENS,
    EstimatorHistory,
    FlowSlots,
    PositionBlocks,
    SlotBatch,
)
from loadtest.flow_bench import OpCount
from tests.detok_stage.test_s3gen_streaming import chunks_of, offline, tokens


def fresh_codec() -> S3GenCodec:
    return S3GenCodec(S3Gen.seeded(tiny_s3gen_config(), 3))


def ops_of_one_chunk(codec: S3GenCodec, requests: int) -> int:
    flow = codec.model.flow
    states = [flow.new_state(codec.default_voice, 10) for _ in range(requests)]
    for s in states:
        s.tokens += list(range(40))
    flow.advance(states, 4)  # first chunk: pools made and grown
    with OpCount() as ops:
        flow.advance(states, 4)
    return ops.count


def test_a_chunk_runs_the_same_ops_for_sixteen_requests_as_for_one():
    """Each layer runs once for the batch: on a GPU, launches do not grow with the requests (the
    per-request loops this replaced issued ~1,200 more ops per added request at the tiny preset)."""
    codec = fresh_codec()
    one, sixteen = ops_of_one_chunk(codec, 1), ops_of_one_chunk(codec, 16)
    print(f"aten ops for one flow chunk: 1 request {one}, 16 requests {sixteen}")
    assert sixteen == one


def ops_of_one_round(codec: S3GenCodec, requests: int) -> int:
    """Ops of the codec's third round over `requests` streams of 12 tokens in 4-token chunks (the tiny
    preset's attention chunk)."""
    streams = [chunks_of(f"g{requests}-{i}", tokens(12, i), 4, 4) for i in range(requests)]
    for index in range(2):
        codec.decode_stream([chunks[index] for chunks in streams])
    with OpCount() as ops:
        codec.decode_stream([chunks[2] for chunks in streams])
    return ops.count


def test_a_codec_round_adds_few_ops_per_request():
    """The whole round (flow, then HiFT's F0, source and generator batched by window) costs about as many
    ops for eight requests as for two: what a request adds is its own bookkeeping (slicing its mel
    and source, joining its audio), not its own forwards (~10,700 ops each before the pools)."""
    codec = fresh_codec()
    two, eight = ops_of_one_round(codec, 2), ops_of_one_round(codec, 8)
    per_request = (eight - two) / 6
    print(f"aten ops for one codec round: 2 requests {two}, 8 requests {eight}: {per_request:.0f} a request")
    assert per_request < 0.05 * two  # (a request's own forwards would add about a whole round)


def test_a_dropped_stream_gives_back_its_slot_and_blocks():
    codec = fresh_codec()
    for i in range(3):
        codec.decode_stream(chunks_of(f"r{i}", tokens(21, i), 4, 5))
    pending = chunks_of("open", tokens(21, 7), 4, 5)
    codec.decode_stream(pending[:2])
    slots = codec.model.flow.slots
    assert len(slots.open_slots) == 1 and codec.cache_bytes("open") > 0
    codec.release("open")
    gc.collect()
    assert not slots.open_slots
    for blocks in slots.blocks.values():
        assert not blocks.owned and len(blocks.free) == blocks.num_blocks


def test_a_reused_slot_starts_from_a_clean_history():
    """The second stream takes the first one's slot (and blocks, holding the first's keys): its audio is
    still the offline audio of its own tokens."""
    codec = fresh_codec()
    first = chunks_of("a", tokens(30, 1), 4, 6)
    codec.decode_stream(first[:3])
    codec.release("a")
    gc.collect()
    toks = tokens(17, 2)
    streamed = torch.cat(codec.decode_stream(chunks_of("b", toks, 3, 4)))
    torch.testing.assert_close(streamed, offline(toks, c=codec), atol=1e-4, rtol=0)


def test_blocks_grow_and_return_in_position_order():
    blocks = PositionBlocks()
    blocks.hold(0, 3 * BLOCK_POSITIONS)
    blocks.hold(1, 10 * BLOCK_POSITIONS)  # past the first 8 blocks: the count grows
    assert blocks.num_blocks >= 13 and len(blocks.owned[1]) == 10
    assert len(set(blocks.owned[0]) | set(blocks.owned[1])) == 13
    blocks.hold(0, 3 * BLOCK_POSITIONS)  # already held: nothing taken
    assert len(blocks.owned[0]) == 3
    blocks.release(1)
    assert len(blocks.free) == blocks.num_blocks - 3
    table = blocks.table([0, 1], 4)
    assert table.tolist() == [blocks.owned[0] + [0], [0, 0, 0, 0]]


def test_keys_written_before_the_pools_grow_are_read_back_after():
    slots = FlowSlots("cpu", frames_per_token=2)
    a, b = slots.open(), slots.open()
    history: dict[int, list[torch.Tensor]] = {a.id: [], b.id: []}
    gen = torch.Generator().manual_seed(0)
    start = 0
    for length in (5, 20, 40):  # each forward needs more blocks than the last: the pools grow twice
        a.hold(start + length)
        b.hold(start + length)
        batch = SlotBatch.build(slots, TOKENS, [a.id, b.id], [start, start], length, chunk=0)
        k = torch.randn(2, 3, length, 4, generator=gen)  # [G * R, H, T, D], one row per request
        keys, values = batch.keys_values("layer", k, -k)
        for g, slot in enumerate((a, b)):
            history[slot.id].append(k[g])
            want = torch.cat(history[slot.id], dim=1)
            assert torch.equal(keys[g], want) and torch.equal(values[g], -want)
        start += length
    assert batch.visible.all()  # equal lengths, no chunking: every key seen by every query


def estimator_bytes_per_chunk(history: EstimatorHistory, chunks: int) -> list[int]:
    """A stream's estimator KV bytes after each of its first `chunks` attention chunks."""
    codec = fresh_codec()
    flow = codec.model.flow
    flow.bound_history(history)
    state = flow.new_state(codec.default_voice, codec.n_timesteps)
    state.tokens += tokens(chunks * flow.config.chunk_tokens + 3, 9).tolist()
    held = []
    for _ in range(chunks):
        flow.advance([state], flow.next_chunk_len(state))
        steps = flow.slots.blocks[STEPS]
        pools = [k for (kind, _), (k, _v) in flow.slots.kv.items() if kind == STEPS]
        block_bytes = BLOCK_POSITIONS * sum(2 * k[0].numel() * k.element_size() for k in pools)
        held.append(steps.held(state.slot.id) * block_bytes)
    return held


def test_a_bounded_history_keeps_a_streams_estimator_memory_fixed():
    """Exact streaming keeps every frame's keys for every Euler step (they grow with the stream); a bounded
    history gives back the blocks behind its window, so a long stream holds what a short one holds."""
    exact = estimator_bytes_per_chunk(EstimatorHistory(), 12)  # chunks of 8 frames, blocks of 16
    bounded = estimator_bytes_per_chunk(EstimatorHistory(sink_frames=16, window_frames=16), 12)
    one_block = exact[0]
    assert exact == sorted(exact) and exact[-1] == 6 * one_block  # 96 frames
    assert bounded[:4] == exact[:4]  # nothing behind the window yet
    # sink: 1 block; window + chunk (24 frames): at most 3 blocks
    assert max(bounded[6:]) <= max(bounded[:6]) <= 4 * one_block and bounded[-1] <= exact[-1] / 2


def test_dropped_blocks_go_back_and_read_as_block_zero():
    blocks = PositionBlocks()
    blocks.hold(0, 6 * BLOCK_POSITIONS)
    first = list(blocks.owned[0])
    blocks.drop(0, BLOCK_POSITIONS + 1, 5 * BLOCK_POSITIONS)  # blocks 2, 3, 4 lie wholly inside
    assert blocks.owned[0] == [first[0], first[1], DROPPED, DROPPED, DROPPED, first[5]]
    assert blocks.held(0) == 3 and sorted(blocks.free[-3:]) == sorted(first[2:5])
    assert blocks.table([0], 6).tolist() == [[first[0], first[1], 0, 0, 0, first[5]]]
    blocks.hold(0, 7 * BLOCK_POSITIONS)  # a later position takes one new block, none of the dropped back
    assert len(blocks.owned[0]) == 7 and blocks.owned[0][2:5] == [DROPPED] * 3
    blocks.release(0)
    assert len(blocks.free) == blocks.num_blocks


def test_a_bounded_batch_reads_its_sink_and_window_and_nothing_else():
    slots = FlowSlots("cpu", frames_per_token=2)
    a = slots.open()
    slots.blocks[STEPS].hold(a.id, 64)
    history = EstimatorHistory(sink_frames=4, window_frames=8)
    batch = SlotBatch.build_bounded(slots, STEPS, [a.id], [40], 6, chunk=8, history=history)  # chunk 40..47
    assert batch.num_keys == 4 + 8 + 8  # at any stream length
    table = slots.blocks[STEPS].table([a.id], 4)[0]
    def row(p: int) -> int:
        return int(table[p // BLOCK_POSITIONS]) * BLOCK_POSITIONS + p % BLOCK_POSITIONS

    visible = batch.visible[0, 0, 0].tolist()
    read = [r for r, v in zip(batch.read[0].tolist(), visible, strict=True) if v]
    assert read == [row(p) for p in [0, 1, 2, 3, *range(32, 46)]]  # sink, then the window up to the last query
    with pytest.raises(ValueError, match="one attention chunk"):
        SlotBatch.build_bounded(slots, STEPS, [a.id], [44], 6, chunk=8, history=history)

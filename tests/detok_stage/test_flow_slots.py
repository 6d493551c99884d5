"""The S3Gen flow's pooled streaming state: one forward per Euler step whatever the batch, slots and
blocks given back when a stream's state is dropped, pools that grow without losing what they hold."""

from __future__ import annotations

import gc

import torch

from detok_stage.codecs.s3gen_codec import S3GenCodec
from detok_stage.flow.config import tiny_s3gen_config
from detok_stage.flow.model import S3Gen
from detok_stage.flow.slots import BLOCK_POSITIONS, FRAMES, TOKENS, FlowSlots, PositionBlocks, SlotBatch
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
    """Ops of the codec's third round over `requests` streams of 75 tokens in 25-token chunks."""
    streams = [chunks_of(f"g{requests}-{i}", tokens(75, i), 25, 25) for i in range(requests)]
    for index in range(2):
        codec.decode_stream([chunks[index] for chunks in streams])
    with OpCount() as ops:
        codec.decode_stream([chunks[2] for chunks in streams])
    return ops.count


def test_a_codec_round_adds_few_ops_per_request():
    """The whole round (flow, then HiFT's F0, source and generator batched by window) costs about as many
    ops for sixteen requests as for four: what a request adds is its own bookkeeping (slicing its mel
    and source, joining its audio), not its own forwards (~10,700 ops each before the pools)."""
    codec = fresh_codec()
    four, sixteen = ops_of_one_round(codec, 4), ops_of_one_round(codec, 16)
    per_request = (sixteen - four) / 12
    print(f"aten ops for one codec round: 4 requests {four}, 16 requests {sixteen}: {per_request:.0f} a request")
    assert per_request < 0.01 * four


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
    for kind in (TOKENS, FRAMES):
        blocks = slots.blocks[kind]
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

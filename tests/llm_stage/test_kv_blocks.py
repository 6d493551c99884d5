"""The paged KV layout's accounting and memory: blocks reserved at admission for every position a
request can reach, refused cleanly (nothing taken) when short, returned on finish, cancel,
preemption and move-out; the KV cap counts free blocks; a cache of 256 rows x 4096 tokens costs
its block budget, not rows x max_seq_len."""

from __future__ import annotations

import pytest
import torch

from core.config import CacheConfig
from core.errors import InvalidArgumentError
from llm_stage.kv_blocks import BlockAllocator
from llm_stage.kv_cache import PagedKVCache, SlotKVCache, make_cache
from tests.factories import fake_request, fake_scheduler, orpheus_engine

PAGED = {"layout": "paged", "block_size": 8}


def test_the_allocator_refuses_without_taking_anything_and_gets_every_block_back():
    blocks = BlockAllocator(num_blocks=10, block_size=4, max_blocks_per_slot=6)
    assert blocks.reserve(0, 9) and blocks.blocks_of(0) == [0, 1, 2] and blocks.capacity(0) == 12
    assert blocks.reserve(0, 12) and blocks.num_free == 7  # already held: nothing more
    assert blocks.reserve(1, 100) and len(blocks.blocks_of(1)) == 6  # capped at a full row
    assert not blocks.reserve(2, 5) and blocks.num_free == 1 and blocks.blocks_of(2) == []
    assert blocks.take_changed() == [(0, [0, 1, 2]), (1, [3, 4, 5, 6, 7, 8])] and blocks.take_changed() == []
    blocks.release(0)
    blocks.release(1)
    assert blocks.num_free == 10 and blocks.take_changed() == [(0, []), (1, [])]


def test_admission_reserves_prompt_plus_max_tokens_and_waits_when_blocks_are_short():
    # 8 slots but 12 blocks of 8 tokens: a 20-token prompt + 20 tokens needs 5 blocks, a CFG pair 10
    scheduler = fake_scheduler(num_slots=8, max_batch_size=8, max_seq_len=64, cache={**PAGED, "num_blocks": 12})
    first, second = fake_request("a", 20, max_tokens=20), fake_request("b", 20, max_tokens=20)
    guided = fake_request("g", 20, max_tokens=20, twin_prompt_len=12)
    for req in (first, second, guided):
        scheduler.add(req)
    plan = scheduler.schedule()
    assert {w.req.req_id for w in plan.prefills} == {"a", "b"} and scheduler.blocks.num_free == 2
    assert guided.slot is None and scheduler.slots.num_used == 2  # waits: slots free, blocks not
    assert scheduler.kv_streams(rows_per_stream=1, positions_per_stream=40) == 2  # running, + 2 // 5 more
    scheduler.cancel("a")
    scheduler.schedule()
    assert scheduler.blocks.num_free == 7 and guided.slot is None  # the pair needs 5 + 4 = 9 blocks
    scheduler.cancel("b")
    plan = scheduler.schedule()
    assert {w.req.req_id for w in plan.prefills} == {"g", "g#uncond"} and scheduler.blocks.num_free == 3


def test_blocks_come_back_on_finish_preemption_and_a_too_long_request_is_refused():
    scheduler = fake_scheduler(cache={**PAGED, "num_blocks": 40})
    req = fake_request("r", 10, max_tokens=3)
    scheduler.add(req)
    scheduler.schedule()
    assert scheduler.blocks.blocks_of(req.slot) == [0, 1]  # 10 + 3 positions: 2 blocks of 8
    scheduler.preempt("r")
    assert scheduler.blocks.num_free == 40 and req.slot is None
    plan = scheduler.schedule()
    finished = []
    while not finished:
        finished = scheduler.update(plan, [5] * len(plan.sampled_requests))
        plan = scheduler.schedule()
    assert finished == [req] and scheduler.blocks.num_free == 40 and scheduler.slots.num_used == 0
    with pytest.raises(InvalidArgumentError, match="KV blocks") as err:
        scheduler.check_reservable(fake_request("huge", 200, max_tokens=200, twin_prompt_len=200))
    assert err.value.field == "sampling.max_tokens"


def test_an_engine_returns_every_block_after_finish_cancel_and_move_out():
    engine = orpheus_engine(num_slots=4, max_seq_len=512, cache=PAGED)
    blocks = engine.scheduler.blocks
    for i in range(3):
        engine.add_request(f"r{i}", f"request {i}", None, {"max_tokens": 40 + 20 * i, "seed": i})
    for _ in range(10):
        engine.step()
    held = blocks.num_used
    assert held == sum(len(blocks.blocks_of(r.slot)) for r in engine.requests.values())
    assert engine.export_kv("r1") is not None and engine.cancel("r1")  # a move-out: snapshot, then cancel
    assert engine.cancel("r2") and blocks.num_used < held
    engine.run_to_completion()
    assert blocks.num_used == 0 and blocks.num_free == blocks.num_blocks


def test_the_paged_cache_costs_its_block_budget_not_rows_times_max_seq_len():
    """Orpheus 3B's shapes (28 layers, 8 KV heads x 128, bf16), on the meta device: 256 rows x 4096
    tokens cost 120 GB as slots; paged, a budget of 256 streams x 1280 tokens (prompt + max_tokens
    1200) costs 37.6 GB whatever max_seq_len is."""
    shapes = (28, 8, 128, torch.bfloat16, torch.device("meta"))
    slot = make_cache(CacheConfig(num_slots=256, max_seq_len=4096), *shapes)
    budget = 256 * 1280 // 16
    paged = make_cache(CacheConfig(num_slots=256, max_seq_len=4096, layout="paged", num_blocks=budget), *shapes)
    assert isinstance(slot, SlotKVCache) and isinstance(paged, PagedKVCache)
    per_token = 28 * 2 * 8 * 128 * 2
    assert per_token == 114_688
    assert slot.num_bytes == 257 * 4096 * per_token  # 120.7 GB
    assert paged.num_bytes == (budget + 1) * 16 * per_token + 257 * 256 * 4  # 37.6 GB + the table
    longer = make_cache(CacheConfig(num_slots=256, max_seq_len=8192, layout="paged", num_blocks=budget), *shapes)
    assert longer.num_bytes - paged.num_bytes == 257 * 256 * 4  # only the table grows

"""An ended request's prompt KV kept in its slot (`llm_stage.kept_prompts`): the scheduler hands the slot
to a request whose prompt starts the same, which prefills only the rest, and gives kept slots back
when requests need them; on GLM-4-Voice (text and speech token ids) and Step-Audio 2 (its clips'
placeholders named by content) a conversation's second turn reusing the first turn's prompt, without
its first clip's front end and encoder again, draws the tokens a fresh engine draws."""

from __future__ import annotations

import numpy as np
import pytest

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from core.messages import AudioClip, ChatTurn
from llm_stage.engine import LLMEngine
from llm_stage.jobs import build_job
from llm_stage.kept_prompts import common_prefix
from llm_stage.models.glm4_voice import Glm4VoiceAdapter
from llm_stage.models.step_audio2 import StepAudio2Adapter
from llm_stage.prompt_work import earlier_turns_key, next_turn_key, prompt_work
from llm_stage.request import Request
from tests.factories import fake_request, fake_scheduler


def kept_request(req_id: str, prompt: list[int], key: str = "k") -> Request:
    req = fake_request(req_id, 0, max_tokens=4)
    req.prompt_ids, req.keeps_prompt_as = list(prompt), key
    return req


def run_to_end(sched, *reqs: Request) -> None:
    """Prefill each request's prompt, then end it (its KV complete up to its prompt)."""
    for req in reqs:
        sched.add(req)
    plan = sched.schedule()
    sched.advance(plan)
    for req in reqs:
        sched.cancel(req.req_id)  # (ended as a barge-in would: after its prompt)


PAGED = {"layout": "paged", "block_size": 16, "num_blocks": 18}  # (16 blocks: one 256-position row)


@pytest.mark.parametrize("cache", [None, PAGED])
def test_a_prompt_kept_after_its_request_serves_the_next_one_that_starts_the_same(cache):
    sched = fake_scheduler(num_slots=2, max_batch_size=2, budget=256, cache=cache)
    first = kept_request("t1", list(range(100, 140)), key="conv-1")
    run_to_end(sched, first)
    assert len(sched.kept) == 1 and sched.kept.keys() == ("conv-1",) and sched.slots.num_free == 1
    (kept_slot,) = sched.kept.by_slot
    second = kept_request("t2", [*range(100, 140), *range(500, 520)])
    sched.add(second)
    plan = sched.schedule()
    assert [(w.req.req_id, w.start, w.num_tokens) for w in plan.prefills] == [("t2", 40, 20)]
    assert second.slot == kept_slot and len(sched.kept) == 0
    assert (sched.kept.num_reuses, sched.kept.num_reused_positions) == (1, 40)
    if sched.blocks is not None:  # the kept prompt's 3 blocks, grown to the new reservation (60 + 4 positions)
        assert len(sched.blocks.blocks_of(second.slot)) == 4 and sched.blocks.num_free == 18 - 4


def test_a_prompt_equal_to_the_kept_one_still_prefills_its_last_position():
    sched = fake_scheduler(num_slots=2, budget=256)
    run_to_end(sched, kept_request("t1", list(range(100, 140))))
    again = kept_request("t2", list(range(100, 140)))
    sched.add(again)
    assert [(w.start, w.num_tokens) for w in sched.schedule().prefills] == [(39, 1)]  # its logits need one


def test_short_common_prefixes_twins_and_requests_that_keep_nothing_take_fresh_slots():
    sched = fake_scheduler(num_slots=6, budget=256)
    run_to_end(sched, kept_request("t1", list(range(100, 140))))
    short = kept_request("s", [*range(100, 110), 7, 8, 9])  # 10 shared: under MIN_REUSED_POSITIONS
    unkept = fake_request("u", 50)
    unkept.prompt_ids = list(range(100, 140))
    guided = fake_request("g", 40, twin_prompt_len=10)
    guided.prompt_ids, guided.keeps_prompt_as = list(range(100, 140)), "k"
    for req in (short, unkept, guided):
        sched.add(req)
    plan = sched.schedule()
    assert all(w.start == 0 for w in plan.prefills) and len(sched.kept) == 1


@pytest.mark.parametrize("cache", [None, PAGED])
def test_kept_slots_are_given_back_oldest_first_when_requests_need_them(cache):
    sched = fake_scheduler(num_slots=2, max_batch_size=2, budget=256, cache=cache)
    run_to_end(sched, kept_request("a", list(range(100, 130)), "A"))
    run_to_end(sched, kept_request("b", list(range(200, 230)), "B"))
    assert sched.slots.num_free == 0 and sched.kept.keys() == ("A", "B")
    sched.add(fake_request("new", 10))
    sched.schedule()
    assert sched.kept.keys() == ("B",) and sched.running["new"].slot is not None
    if sched.blocks is not None:  # B keeps only its prompt's 2 blocks; "new" reserved its own 4 (10 + 50)
        assert sched.blocks.num_free == 18 - 2 - 4


def test_paged_kept_prompts_keep_only_their_prompts_blocks_and_give_them_back_when_blocks_run_short():
    sched = fake_scheduler(num_slots=8, max_batch_size=2, budget=256, cache=PAGED)
    run_to_end(sched, kept_request("a", list(range(100, 140)), "A"))  # 40 + 4 reserved: 3 blocks, all kept
    assert sched.blocks.num_free == 18 - 3 and sched.kv_streams(1, 60) == 18 // 4  # kept blocks count as free
    big = fake_request("big", 250, max_tokens=6)  # 256 positions: 16 blocks, more than are free
    sched.add(big)
    sched.schedule()
    assert len(sched.kept) == 0 and len(sched.blocks.blocks_of(big.slot)) == 16


def test_a_request_ended_before_its_prompt_was_in_keeps_nothing_and_a_failed_step_keeps_none():
    sched = fake_scheduler(num_slots=2, budget=16)
    partial = kept_request("p", list(range(100, 140)))
    sched.add(partial)
    sched.advance(sched.schedule())  # 16 of 40 positions in
    sched.cancel("p")
    assert len(sched.kept) == 0 and sched.slots.num_free == 2
    run_to_end(sched, kept_request("q", list(range(100, 110))))
    plan = sched.schedule()
    sched.retreat(plan)  # (a step that ran out of memory: what it was to write is not there)
    assert len(sched.kept) == 0 and sched.slots.num_free == 2


# ---- speech in: a conversation's next turn (GLM-4-Voice's ids; Step-Audio 2's clips by content) --------------


@pytest.fixture(scope="module")
def glm() -> Glm4VoiceAdapter:
    return Glm4VoiceAdapter.build(ModelConfig(name="glm4-voice-tiny", seed=0))


@pytest.fixture(scope="module")
def step_audio() -> StepAudio2Adapter:
    return StepAudio2Adapter.build(ModelConfig(name="step-audio2-tiny", seed=0))


def clip(seconds: float, hz: float) -> AudioClip:
    t = np.arange(round(seconds * 16_000)) / 16_000
    return AudioClip((0.3 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2").tobytes(), 16_000)


def engine(adapter, keep: bool, async_steps: bool = False, layout: str = "slot") -> LLMEngine:
    return LLMEngine(
        adapter, CacheConfig(num_slots=3, max_seq_len=1024, keep_prompts=keep, layout=layout, block_size=16),
        SchedulerConfig(max_batch_size=3, prefill_token_budget=64, async_steps=async_steps),
    )  # fmt: skip


GREEDY = {"temperature": 0.0, "max_tokens": 30, "repetition_penalty": 1.0}


@pytest.mark.parametrize(
    ("family", "async_steps", "layout"),
    [("glm", False, "slot"), ("glm", True, "slot"), ("glm", False, "paged"), ("step_audio", False, "slot"),
     ("step_audio", False, "paged")],
)  # fmt: skip
def test_the_second_turn_reuses_the_first_turns_prompt_and_draws_what_a_fresh_engine_draws(
    request, family: str, async_steps: bool, layout: str
) -> None:
    adapter = request.getfixturevalue(family)
    adapter.forget_kept_clips()
    first = build_job(adapter, text="", audio=clip(1.2, 220), sampling=GREEDY, req_id="t1")
    history = (ChatTurn("user", "", first.audio), ChatTurn("assistant", "Sure."))
    second = build_job(adapter, text="And?", audio=clip(0.8, 330), sampling=GREEDY, req_id="t2", history=history)
    other = build_job(adapter, text="Tell me a story.", sampling=GREEDY, req_id="other")  # in the same batches
    reused = engine(adapter, keep=True, async_steps=async_steps, layout=layout)
    reused.add_job(first)
    first_prompt = list(reused.requests["t1"].prompt_ids)
    reused.run_to_completion()
    assert reused.scheduler.kept.keys() == (next_turn_key(first),) == (earlier_turns_key(second),)
    reused.add_job(second)
    assert adapter.front_end_seconds(second) == pytest.approx(0.8)  # the first clip's front end did not run again
    shared = common_prefix(tuple(first_prompt), reused.requests["t2"].prompt_ids)  # (Step-Audio 2: to <tts_start>)
    assert shared >= len(first_prompt) - 1
    reused.add_job(other)
    got = reused.run_to_completion()
    assert (reused.scheduler.kept.num_reuses, reused.scheduler.kept.num_reused_positions) == (1, shared)
    adapter.forget_kept_clips()
    fresh = engine(adapter, keep=False)
    fresh.add_job(second)
    fresh.add_job(other)
    want = fresh.run_to_completion()
    assert got["t2"] == want["t2"] and got["other"] == want["other"] and len(got["t2"]) > 0
    assert len(fresh.scheduler.kept) == 0  # (off: nothing kept)


def test_the_routers_estimate_of_the_next_turn_names_the_kept_prompt_and_what_it_saves(glm):
    first = build_job(glm, text="", audio=clip(1.2, 220), req_id="t1")
    history = (ChatTurn("user", "", first.audio), ChatTurn("assistant", "Sure."))
    second = build_job(glm, text="And?", audio=clip(0.8, 330), req_id="t2", history=history)
    work = prompt_work(Glm4VoiceAdapter, second)
    assert work.earlier_key == next_turn_key(first) and work.earlier_audio_s == pytest.approx(1.2)
    assert work.earlier_positions == Glm4VoiceAdapter.estimate_prompt_positions(first)
    here = work.on_kept_prompt()
    assert here.num_positions == work.num_positions - work.earlier_positions and here.audio_s == pytest.approx(0.8)
    assert prompt_work(Glm4VoiceAdapter, first).earlier_key is None  # a first turn has none

"""Starts timed to the output head's phase (Orpheus' frame slots), so staggered streams decode in lockstep."""

from __future__ import annotations

from cluster.config import CacheConfig, SchedulerConfig
from llm_stage.models.orpheus import slot_of
from llm_stage.request import RequestStatus
from llm_stage.scheduler import Scheduler
from tests.factories import EOS_FAKE, fake_request, orpheus_engine

PERIOD = 7


def phased_scheduler(period: int = PERIOD, decode_order=None) -> Scheduler:
    extra = {} if decode_order is None else {"decode_order": decode_order}
    return Scheduler(
        SchedulerConfig(max_batch_size=4, prefill_token_budget=64), CacheConfig(num_slots=4, max_seq_len=256),
        [EOS_FAKE], head_phase_period=period, **extra,
    )  # fmt: skip


def step(sched: Scheduler) -> set[str]:
    """One step with a non-stop token per sampled row; returns the ids whose prompt completed."""
    plan = sched.schedule()
    started = {w.req.req_id for w in plan.prefills if w.completes_prompt}
    sched.update(plan, [7] * len(plan.sampled_requests))
    return started


def next_phase(req) -> int:
    return len(req.output_ids) % PERIOD


def test_a_new_request_waits_for_the_running_rows_phase_then_decodes_in_lockstep():
    sched = phased_scheduler()
    first = fake_request("a", prompt_len=5, max_tokens=100)
    sched.add(first)
    assert step(sched) == {"a"}  # nothing decoding: starts at once
    for _ in range(2):
        step(sched)
    assert next_phase(first) == 3
    sched.add(fake_request("b", prompt_len=5, max_tokens=100))
    held = 0
    while not step(sched):
        held += 1
    assert held == PERIOD - 3  # waited until "a" samples a phase-0 token again
    second = sched.running["b"]
    for _ in range(10):
        assert next_phase(first) == next_phase(second)
        step(sched)


def test_a_start_waits_at_most_one_period_less_one_step():
    sched = phased_scheduler(decode_order=lambda decoding: [])  # the decoding row never advances
    first = fake_request("a", prompt_len=5)
    sched.add(first)
    step(sched)
    step(sched)  # "a" sampled its first token; its next phase is 1, frozen from here on
    assert first.status is RequestStatus.DECODING
    sched.add(fake_request("b", prompt_len=5))
    held = 0
    while not step(sched):
        held += 1
    assert held == PERIOD - 1


def test_without_a_head_cycle_a_request_starts_at_once():
    sched = phased_scheduler(period=1)
    sched.add(fake_request("a", prompt_len=5, max_tokens=100))
    step(sched)
    step(sched)
    sched.add(fake_request("b", prompt_len=5, max_tokens=100))
    assert step(sched) == {"b"}


def run_staggered(align: bool) -> tuple[list[set[int]], dict[str, list[int]]]:
    """Three greedy Orpheus requests added two steps apart; the set of frame slots sampled per step."""
    engine = orpheus_engine(align_starts=align)
    slots_per_step, outputs = [], {}
    params = engine.adapter.default_sampling.model_copy(update={"temperature": 0.0, "max_tokens": 70})
    for step_index in range(300):
        if step_index in (0, 2, 4):
            engine.add_request(f"r{step_index}", "Hello there.", None, params)
        decoding = [r for r in engine.scheduler.running.values() if r.status is RequestStatus.DECODING]
        if len(decoding) == 3:
            slots_per_step.append({slot_of(len(r.output_ids)) for r in decoding})
        for out in engine.step():
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
        if not engine.has_work:
            break
    return slots_per_step, outputs


def test_orpheus_streams_started_apart_share_one_slot_head_and_keep_their_greedy_tokens():
    aligned_slots, aligned = run_staggered(align=True)
    staggered_slots, staggered = run_staggered(align=False)
    assert aligned_slots and all(len(slots) == 1 for slots in aligned_slots)
    assert all(len(slots) == 3 for slots in staggered_slots)
    assert aligned == staggered  # a later start changes when, not what

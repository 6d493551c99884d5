"""Starts timed to the output head's phase (Orpheus' frame slots), so staggered streams decode in lockstep."""

from __future__ import annotations

from core.config import CacheConfig, SchedulerConfig
from core.policy import DecodePriority, PolicyKind, SchedulingPolicy, fcfs_order
from llm_stage.kv_slots import SlotAllocator
from llm_stage.models.orpheus import slot_of
from llm_stage.request import RequestStatus
from llm_stage.scheduler import Scheduler
from tests.factories import EOS_FAKE, fake_request, orpheus_engine

PERIOD = 7


def phased_scheduler(period: int = PERIOD, decode_order=fcfs_order) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_batch_size=4, prefill_token_budget=64), CacheConfig(num_slots=4, max_seq_len=256),
        [EOS_FAKE], SchedulingPolicy(PolicyKind.FCFS, decode_order, head_phase_period=period),
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
    sched = phased_scheduler(decode_order=lambda decoding, waiting: [])  # the decoding row never advances
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


def decoding_at_phase(sched: Scheduler, req_id: str, phase: int, arrival_s: float):
    """A decoding row whose next sampled token falls in `phase`."""
    req = fake_request(req_id, prompt_len=5, max_tokens=100)
    req.arrival_s = arrival_s
    req.status, req.slot = RequestStatus.DECODING, sched.slots.allocate()
    req.output_ids = [7] * (PERIOD + phase)
    req.num_cached = req.num_known - 1  # the last sampled token is not in the cache yet
    assert next_phase(req) == phase
    sched.running[req_id] = req
    return req


def test_rows_that_can_wait_fill_the_batch_in_its_head_phase_first():
    order = lambda decoding, waiting: DecodePriority(  # noqa: E731
        [r for r in decoding if r.req_id == "urgent"],
        can_wait=[r for r in decoding if r.req_id.startswith("fill")],
        last=[r for r in decoding if r.req_id == "deferred"],
    )
    sched = phased_scheduler(decode_order=order)
    sched.config = SchedulerConfig(max_batch_size=3)
    sched.slots = SlotAllocator(8)
    decoding_at_phase(sched, "urgent", 2, arrival_s=1)
    decoding_at_phase(sched, "fill-off", 5, arrival_s=2)  # first in the policy's order, but out of phase
    decoding_at_phase(sched, "fill-in-a", 2, arrival_s=3)
    decoding_at_phase(sched, "fill-in-b", 2, arrival_s=4)
    decoding_at_phase(sched, "deferred", 2, arrival_s=5)  # in phase, but after every fill row
    assert [r.req_id for r in sched.schedule().decodes] == ["urgent", "fill-in-a", "fill-in-b"]
    del sched.running["fill-in-a"], sched.running["fill-in-b"]
    plan = sched.schedule()  # the fill rows all fit: nothing reordered, `last` after `can_wait`
    assert [r.req_id for r in plan.decodes] == ["urgent", "fill-off", "deferred"]


def test_streams_sharing_too_few_rows_decode_in_one_phase_and_all_advance():
    def least_decoded_first(decoding, waiting):
        return DecodePriority([], can_wait=sorted(decoding, key=lambda r: len(r.output_ids)))

    sched = phased_scheduler(decode_order=least_decoded_first)
    sched.config = SchedulerConfig(max_batch_size=3)
    sched.slots = SlotAllocator(8)
    streams = [decoding_at_phase(sched, f"s{i}", phase, arrival_s=i) for i, phase in enumerate([0, 3, 5, 6])]
    phases_per_step = []
    for _ in range(4 * PERIOD):
        plan = sched.schedule()
        phases_per_step.append({next_phase(r) for r in plan.decodes})
        sched.update(plan, [7] * len(plan.sampled_requests))
    assert all(len(phases) == 1 for phases in phases_per_step[2 * PERIOD :])  # one head matmul a step
    assert min(len(r.output_ids) for r in streams) >= PERIOD + 2 * PERIOD  # none starved

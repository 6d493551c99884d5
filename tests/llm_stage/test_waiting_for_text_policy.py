"""Policy (issue 27): a stream idle for text does not hurt the running streams. The real scheduler
with the streaming-aware order on a fake clock: streams that play at 2x real time in a full batch
keep every chunk on time, and their batches are step for step the ones they get without the idle
stream, whether it waits in its startup phase (the highest priority) or mid-playback."""

from __future__ import annotations

import pytest

from core.config import CacheConfig, SchedulerConfig
from core.messages import SamplingParams
from core.policy import PolicyKind, SchedulingPolicy, StepTimer, StreamingOrder
from llm_stage.request import Request, RequestStatus
from llm_stage.scheduler import Scheduler
from llm_stage.text_feed import TextFeed, split_whole

STEP_S = 0.01
AUDIO_PER_TOKEN_S = 0.02  # a decode step ships 2x real time per row
SAMPLING = SamplingParams(temperature=0.0, max_tokens=100_000)


class FakeClock:
    now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def decoding(scheduler: Scheduler, req_id: str, arrival_s: float, first_audio_s: float | None) -> Request:
    req = Request(req_id, [1, 2], SAMPLING, arrival_s=arrival_s)
    req.status, req.slot, req.num_cached, req.output_ids = RequestStatus.DECODING, scheduler.slots.allocate(), 2, [5]
    req.first_audio_s, req.audio_sent_s, req.tokens_to_next_chunk = first_audio_s, 0.3, 1
    scheduler.running[req_id] = req
    return req


def simulate(idle_phase: str | None, num_steps: int = 300) -> tuple[list[list[str]], int, Scheduler]:
    """Three playing streams in a batch of three, plus (unless None) a streaming-text stream that has
    read all its text: in its startup phase ("startup") or with audio playing out ("playing")."""
    clock = FakeClock()
    timer = StepTimer(step_s=STEP_S, detok_s=0.02)
    policy = SchedulingPolicy(PolicyKind.STREAMING, StreamingOrder(startup_concurrency=4, timer=timer, clock=clock))
    scheduler = Scheduler(SchedulerConfig(max_batch_size=3), CacheConfig(num_slots=8, max_seq_len=100_000), [0], policy)
    streams = [decoding(scheduler, f"s{i}", arrival_s=i, first_audio_s=clock.now_s) for i in range(3)]
    if idle_phase is not None:
        idle = decoding(scheduler, "idle", 50.0, None if idle_phase == "startup" else clock.now_s - 5.0)
        idle.text_feed = TextFeed(split_whole(lambda text: [ord(c) for c in text]), (9,), 8, first_position=1)
        assert idle.is_waiting_for_text  # its next position (2) reads text id 1: none has arrived
    plans, num_late = [], 0
    for _ in range(num_steps):
        plan = scheduler.schedule()
        plans.append([r.req_id for r in plan.decodes])
        scheduler.update(plan, [5] * len(plan.sampled_requests))
        for req in plan.decodes:
            req.audio_sent_s += AUDIO_PER_TOKEN_S
        clock.now_s += STEP_S
        num_late += sum(s.first_audio_s + s.audio_sent_s < clock.now_s for s in streams)
    return plans, num_late, scheduler


@pytest.mark.parametrize("idle_phase", ["startup", "playing"])
def test_a_stream_idle_for_text_takes_no_row_and_changes_no_running_streams_batch(idle_phase):
    alone, late_alone, _ = simulate(None)
    plans, num_late, scheduler = simulate(idle_phase)
    assert plans == alone and not any("idle" in plan for plan in plans)
    assert num_late == late_alone == 0  # every running stream stayed viable
    idle = scheduler.running["idle"]
    assert idle.slot is not None and scheduler.slots.num_used == 4  # its KV stays
    idle.text_feed.push("ab")  # text ids 0 and 1 arrive (position 2 reads id 1): it is scheduled again
    assert not idle.is_waiting_for_text
    assert "idle" in [r.req_id for r in scheduler.schedule().decodes]

"""Streaming-aware policy on a fake clock, no model: scheduler rows and detokenizer order."""

from __future__ import annotations

import torch

from core.config import CacheConfig, DetokConfig, SchedulerConfig
from core.messages import SamplingParams, TokenChunk
from core.policy import MIN_STEP_SAMPLES, PolicyKind, SchedulingPolicy, StepTimer, StreamingOrder, make_policy
from detok_stage.codecs.base import CodecAdapter
from detok_stage.engine import DetokEngine
from llm_stage.request import Request, RequestStatus
from llm_stage.scheduler import Scheduler


class FakeClock:
    def __init__(self, now_s: float = 100.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def running(scheduler: Scheduler, req_id: str, arrival_s: float, first_audio_s=None, sent_s=0.0, next_tokens=7):
    req = Request(req_id, [1, 2], SamplingParams(), arrival_s=arrival_s)
    req.status, req.slot, req.num_cached = RequestStatus.DECODING, scheduler.slots.allocate(), 2
    req.output_ids = [5]
    req.first_audio_s, req.audio_sent_s, req.tokens_to_next_chunk = first_audio_s, sent_s, next_tokens
    scheduler.running[req_id] = req
    return req


def streaming_scheduler(batch: int, clock: FakeClock, startup: int = 4, prefill_budget: int | None = None) -> Scheduler:
    """10 ms steps, 50 ms detokenizer calls; `prefill_budget` prompt positions a step (None: the
    policy counts a prompt as one step, the scheduler prefills the config's default)."""
    timer = StepTimer(step_s=0.01, detok_s=0.05)
    order = StreamingOrder(startup_concurrency=startup, timer=timer, clock=clock, prefill_token_budget=prefill_budget)
    policy = SchedulingPolicy(PolicyKind.STREAMING, order)
    config = SchedulerConfig(max_batch_size=batch, prefill_token_budget=prefill_budget or 256)
    return Scheduler(config, CacheConfig(num_slots=16), [0], policy)


def picked(scheduler: Scheduler) -> list[str]:
    return [r.req_id for r in scheduler.schedule().decodes]


def test_new_request_goes_ahead_of_comfortable_streams():
    clock = FakeClock()
    sched = streaming_scheduler(batch=2, clock=clock)
    running(sched, "comfy-a", arrival_s=1, first_audio_s=95.0, sent_s=20.0)  # 15 s buffered
    running(sched, "comfy-b", arrival_s=2, first_audio_s=95.0, sent_s=12.0)  # 7 s buffered
    running(sched, "new", arrival_s=50)  # no audio yet
    assert picked(sched) == ["new", "comfy-b"]


def test_stream_about_to_underrun_goes_ahead_of_one_with_slack():
    clock = FakeClock()
    sched = streaming_scheduler(batch=1, clock=clock)
    running(sched, "slack", arrival_s=1, first_audio_s=90.0, sent_s=20.0)  # 10 s buffered
    running(sched, "tight", arrival_s=2, first_audio_s=90.0, sent_s=10.2)  # 0.2 s buffered
    assert picked(sched) == ["tight"]
    clock.now_s = 80.0  # both far ahead now: the one with less slack still first
    assert picked(sched) == ["tight"]


def test_urgent_streams_are_earliest_deadline_first():
    clock = FakeClock()
    sched = streaming_scheduler(batch=3, clock=clock)
    running(sched, "later", arrival_s=1, first_audio_s=99.0, sent_s=1.3)  # deadline 100.3
    running(sched, "sooner", arrival_s=2, first_audio_s=99.0, sent_s=1.1)  # deadline 100.1
    running(sched, "fine", arrival_s=3, first_audio_s=90.0, sent_s=30.0)
    assert picked(sched) == ["sooner", "later", "fine"]


def test_startup_limit_keeps_running_streams_from_starving():
    clock = FakeClock()
    sched = streaming_scheduler(batch=3, clock=clock, startup=2)
    running(sched, "comfy", arrival_s=1, first_audio_s=95.0, sent_s=7.0)  # 2 s buffered
    for i in range(5):
        running(sched, f"new{i}", arrival_s=10 + i)
    assert picked(sched) == ["new0", "new1", "comfy"]
    fcfs = Scheduler(SchedulerConfig(max_batch_size=3), CacheConfig(num_slots=16), [0])  # FCFS
    fcfs.running = sched.running
    assert "comfy" in picked(fcfs)  # arrived first, so FCFS keeps it too; the limit is what protects it


def test_urgent_streams_keep_their_rows_ahead_of_startups():
    clock = FakeClock()
    sched = streaming_scheduler(batch=3, clock=clock, startup=2)
    running(sched, "urgent", arrival_s=1, first_audio_s=99.0, sent_s=1.4)  # 0.4 s buffered: slack 0.28 s
    running(sched, "comfy", arrival_s=2, first_audio_s=95.0, sent_s=7.0)
    for i in range(3):
        running(sched, f"new{i}", arrival_s=10 + i)
    assert picked(sched) == ["urgent", "new0", "new1"]  # the comfortable stream waits, the urgent one never


def capacity_scheduler(clock: FakeClock, step_s: float, batch: int = 3) -> Scheduler:
    """A streaming scheduler whose policy knows a full batch's step time and an 80 ms frame."""
    timer = StepTimer(step_s=step_s, detok_s=0.05, steps_per_frame=7, frame_s=0.08)
    for _ in range(MIN_STEP_SAMPLES):
        timer.record_step(step_s, rows=batch)
    order = StreamingOrder(startup_concurrency=2, timer=timer, clock=clock, max_batch_size=batch)
    policy = SchedulingPolicy(PolicyKind.STREAMING, order)
    return Scheduler(SchedulerConfig(max_batch_size=batch), CacheConfig(num_slots=16), [0], policy)


def test_sustainable_streams_is_rows_times_per_row_speed_at_the_largest_batch_measured():
    timer = StepTimer(steps_per_frame=7)
    for _ in range(MIN_STEP_SAMPLES):
        timer.record_step(0.005, rows=1)
    assert timer.sustainable_streams(4) is None  # no frame duration yet
    timer.record_audio(0.32, 4)  # 80 ms frames
    assert abs(timer.sustainable_streams(4) - 4 * 0.08 / (7 * 0.005)) < 1e-9  # only 1 row measured yet
    for _ in range(MIN_STEP_SAMPLES):
        timer.record_step(0.010, rows=4)
        timer.record_step(0.001, rows=8)  # past the batch cap: ignored
    assert abs(timer.sustainable_streams(4) - 4 * 0.08 / (7 * 0.010)) < 1e-9


def three_playing_and_a_new_one(sched: Scheduler) -> Scheduler:
    for i in range(3):
        running(sched, f"comfy{i}", arrival_s=i, first_audio_s=95.0, sent_s=7.0 + i)  # 2-4 s buffered
    running(sched, "new", arrival_s=10)
    return sched


def test_startup_waits_like_fcfs_when_the_batch_cannot_carry_one_more_stream():
    clock = FakeClock()
    # 3 rows at 10 ms a step: each row makes 80 ms of audio per 70 ms, so 3.4 streams are sustained
    sched = three_playing_and_a_new_one(capacity_scheduler(clock, step_s=0.010))
    assert picked(sched) == ["comfy0", "comfy1", "comfy2"]  # a 4th stream would starve them all
    del sched.running["comfy2"]
    assert picked(sched) == ["new", "comfy0", "comfy1"]  # room for one more: the startup goes first
    fast = three_playing_and_a_new_one(capacity_scheduler(clock, step_s=0.005))  # 6.9 streams sustained
    assert picked(fast) == ["new", "comfy0", "comfy1"]
    barely = three_playing_and_a_new_one(capacity_scheduler(clock, step_s=0.0082))  # 4.2 sustained
    assert picked(barely) == ["comfy0", "comfy1", "comfy2"]  # a 4th stream would leave no margin for jitter


def test_urgent_streams_go_oldest_first_when_more_play_than_the_batch_sustains():
    clock = FakeClock()
    sched = capacity_scheduler(clock, step_s=0.010)  # 3 rows sustain 3.4 streams
    # all urgent: 50-150 ms buffered, 120 ms to make and decode the next chunk
    running(sched, "old1", arrival_s=1, first_audio_s=99.0, sent_s=1.15)
    running(sched, "old2", arrival_s=2, first_audio_s=99.0, sent_s=1.1)
    running(sched, "old3", arrival_s=3, first_audio_s=99.0, sent_s=1.12)
    running(sched, "young", arrival_s=4, first_audio_s=99.0, sent_s=1.05)  # the earliest deadline
    assert picked(sched) == ["old1", "old2", "old3"]  # one stream must miss: the newest, not all four in turn
    del sched.running["old3"]
    assert picked(sched) == ["young", "old2", "old1"]  # within capacity: earliest deadline first


def test_throughput_mode_fills_the_batch_ignoring_deadlines():
    clock = FakeClock()
    config = SchedulerConfig(policy="throughput", max_batch_size=4)
    sched = Scheduler(config, CacheConfig(num_slots=16), [0], make_policy(config, StepTimer()))
    for i in range(6):
        running(sched, f"r{i}", arrival_s=i, first_audio_s=clock.now_s - 1, sent_s=100.0)
    assert picked(sched) == ["r0", "r1", "r2", "r3"]


class _ZeroCodec(CodecAdapter):
    codes_per_frame, samples_per_frame, sample_rate_hz, codebook_size = 1, 4, 8, 16

    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        return torch.zeros(frames.shape[0], frames.shape[1] * self.samples_per_frame)


def _three_chunks(policy: str) -> DetokEngine:
    detok_policy = make_policy(SchedulerConfig(policy=policy))
    engine = DetokEngine(_ZeroCodec(), DetokConfig(max_batch_chunks=2), in_order=False, policy=detok_policy)
    engine.submit(TokenChunk("late", 3, [[1]], 3, 3, 4, False, deadline_s=50.0))
    engine.submit(TokenChunk("soon", 5, [[1]], 5, 5, 6, False, deadline_s=10.0))
    engine.submit(TokenChunk("new", 0, [[1]], 0, 0, 1, False, deadline_s=None))
    return engine


def test_detok_streaming_order_startup_then_earliest_deadline():
    engine = _three_chunks("streaming")
    assert {a.req_id for a in engine.step()} == {"new", "soon"}
    assert [a.req_id for a in engine.step()] == ["late"]
    fcfs = _three_chunks("fcfs")
    assert {a.req_id for a in fcfs.step()} == {"late", "soon"}


def waiting(
    scheduler: Scheduler, req_id: str, arrival_s: float, first_chunk_tokens: int = 28, prompt_len: int = 3
) -> Request:
    req = Request(req_id, [1] * prompt_len, SamplingParams(), arrival_s=arrival_s)
    req.tokens_to_next_chunk = first_chunk_tokens  # as LLMSide sets it for every request it chunks
    scheduler.add(req)
    return req


def test_new_request_is_prefilled_ahead_of_running_streams_when_rows_are_full():
    clock = FakeClock()
    sched = streaming_scheduler(batch=2, clock=clock, startup=2)
    running(sched, "comfy", arrival_s=1, first_audio_s=95.0, sent_s=20.0)
    running(sched, "urgent", arrival_s=2, first_audio_s=99.0, sent_s=1.4)
    waiting(sched, "new", arrival_s=50)
    plan = sched.schedule()
    assert [w.req.req_id for w in plan.prefills] == ["new"]
    assert [r.req_id for r in plan.decodes] == ["urgent"]  # the comfortable stream waits a step
    fcfs = Scheduler(SchedulerConfig(max_batch_size=2), CacheConfig(num_slots=16), [0])  # FCFS
    running(fcfs, "a", arrival_s=1, first_audio_s=95.0, sent_s=20.0)
    running(fcfs, "b", arrival_s=2, first_audio_s=99.0, sent_s=1.2)
    waiting(fcfs, "new", arrival_s=50)
    assert fcfs.schedule().prefills == []  # FCFS: the new request waits for a free row


def test_new_request_waits_while_every_running_stream_is_urgent():
    clock = FakeClock()
    sched = streaming_scheduler(batch=2, clock=clock, startup=2)
    running(sched, "a", arrival_s=1, first_audio_s=99.0, sent_s=1.4)  # slack 0.28 s
    running(sched, "b", arrival_s=2, first_audio_s=99.5, sent_s=0.9)
    waiting(sched, "new", arrival_s=50)  # its first chunk (28 tokens) would hold both rows 0.14 s
    plan = sched.schedule()
    assert [r.req_id for r in plan.decodes] == ["a", "b"] and plan.prefills == []
    clock.now_s = 90.0  # the same streams with seconds of buffer: the new request goes first
    plan = sched.schedule()
    assert [w.req.req_id for w in plan.prefills] == ["new"] and [r.req_id for r in plan.decodes] == ["a"]


def test_urgency_horizon_grows_with_the_startups_queued():
    clock = FakeClock()
    sched = streaming_scheduler(batch=2, clock=clock, startup=2)
    running(sched, "a", arrival_s=1, first_audio_s=99.0, sent_s=1.4)  # slack 0.28 s
    running(sched, "b", arrival_s=2, first_audio_s=99.5, sent_s=0.9)
    waiting(sched, "short", arrival_s=50, first_chunk_tokens=7)  # holds 2 rows 40 ms: horizon 0.21 s
    plan = sched.schedule()
    assert [w.req.req_id for w in plan.prefills] == ["short"] and [r.req_id for r in plan.decodes] == ["a"]
    del sched.running["short"]  # admitted by that plan; gone again
    assert picked(sched) == ["a", "b"]  # nothing queued: a 0.05 s horizon, both streams fill the batch
    for i in range(3):  # three queued: the horizon reaches its 0.3 s cap; both streams keep their rows
        waiting(sched, f"q{i}", arrival_s=60 + i, first_chunk_tokens=7)
    plan = sched.schedule()
    assert plan.prefills == [] and [r.req_id for r in plan.decodes] == ["a", "b"]


def test_a_long_prompt_queued_counts_its_prefill_steps_in_the_urgency_horizon():
    """A 320-position prompt (a 25 s spoken prompt is ~315) at 64 positions a step holds a row for 5
    prefill steps: the horizon counts them (0.29 s), not one (0.21 s), so a stream with 0.28 s of
    slack, which yielded its row to that prompt before, keeps it now."""
    clock = FakeClock()
    sched = streaming_scheduler(batch=2, clock=clock, startup=2, prefill_budget=64)
    running(sched, "a", arrival_s=1, first_audio_s=99.0, sent_s=1.4)  # slack 0.28 s
    running(sched, "b", arrival_s=2, first_audio_s=99.5, sent_s=0.9)  # slack 0.28 s
    spoken = waiting(sched, "spoken", arrival_s=50, first_chunk_tokens=7, prompt_len=320)
    order = sched.policy.order
    assert order.prefill_steps(spoken) == 5
    assert abs(order.urgent_horizon_s([], [spoken]) - (4 * (7 + 5) / 2 * 0.01 + 0.05)) < 1e-9  # 0.29 s
    plan = sched.schedule()
    assert plan.prefills == [] and [r.req_id for r in plan.decodes] == ["a", "b"]  # both streams urgent
    sched.waiting.remove(spoken)
    waiting(sched, "typed", arrival_s=51, first_chunk_tokens=7, prompt_len=3)  # one step: horizon 0.21 s
    plan = sched.schedule()
    assert [w.req.req_id for w in plan.prefills] == ["typed"] and [r.req_id for r in plan.decodes] == ["a"]


def test_a_startup_part_way_through_a_long_prefill_counts_the_steps_it_has_left():
    """Once its first 64 positions are in, a 320-position prompt still holds a row for 4 steps (a 0.27 s
    horizon): streams with 0.2 s and 0.25 s of slack keep their rows. Counted only while waiting, it
    fell out of the horizon after its first prefill step, and they gave their rows up on 0.05 s."""
    clock = FakeClock()
    sched = streaming_scheduler(batch=2, clock=clock, startup=2, prefill_budget=64)
    running(sched, "a", arrival_s=1, first_audio_s=99.0, sent_s=1.32)  # slack 0.2 s
    running(sched, "b", arrival_s=2, first_audio_s=99.0, sent_s=1.37)  # slack 0.25 s
    spoken = Request("spoken", [1] * 320, SamplingParams(), arrival_s=50)
    spoken.status, spoken.slot, spoken.num_cached = RequestStatus.PREFILLING, sched.slots.allocate(), 64
    spoken.tokens_to_next_chunk = 7
    sched.running["spoken"] = spoken
    assert sched.policy.order.prefill_steps(spoken) == 4
    plan = sched.schedule()
    assert plan.prefills == [] and [r.req_id for r in plan.decodes] == ["a", "b"]
    clock.now_s = 90.0  # the same streams with seconds of buffer: the prompt goes on prefilling
    plan = sched.schedule()
    assert [(w.req.req_id, w.start, w.num_tokens) for w in plan.prefills] == [("spoken", 64, 64)]


def test_make_policy_counts_prompts_at_the_schedulers_prefill_budget():
    order = make_policy(SchedulerConfig(policy="streaming", prefill_token_budget=100)).order
    assert order.prefill_steps(Request("long", [1] * 250, SamplingParams())) == 3
    assert order.prefill_steps(Request("short", [1] * 2, SamplingParams())) == 1


def test_prefills_ahead_count_against_the_startup_limit():
    clock = FakeClock()
    sched = streaming_scheduler(batch=3, clock=clock, startup=2)
    running(sched, "starting", arrival_s=1)  # decoding its first chunk: one startup place taken
    running(sched, "comfy-a", arrival_s=2, first_audio_s=95.0, sent_s=20.0)
    running(sched, "comfy-b", arrival_s=3, first_audio_s=95.0, sent_s=19.0)
    for i in range(3):
        waiting(sched, f"new{i}", arrival_s=50 + i)
    plan = sched.schedule()
    assert [w.req.req_id for w in plan.prefills] == ["new0"]
    assert [r.req_id for r in plan.decodes] == ["starting", "comfy-b"]


def test_the_positions_waiting_to_prefill_count_new_prompts_twins_and_startups_part_way():
    """What the replica reports for the router's queued-prefill charge: every waiting prompt (a guided
    one's twin too) and a startup's positions not yet in the cache; a playing stream's are not counted."""
    from tests.factories import fake_request, fake_scheduler

    sched = fake_scheduler(num_slots=4, max_batch_size=4, budget=64)
    sched.add(fake_request("long", 200))
    sched.add(fake_request("guided", 30, twin_prompt_len=20))
    assert sched.positions_to_prefill() == 250
    sched.schedule()  # the first 64 positions of "long" go in this step
    sched.running["long"].num_cached = 64
    assert sched.positions_to_prefill() == 250 - 64
    sched.running["long"].first_audio_s = 1.0  # playing: no startup, whatever it has left
    assert sched.positions_to_prefill() == 50

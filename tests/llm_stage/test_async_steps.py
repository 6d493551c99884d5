"""Async steps: the forward runs on a worker thread while the next batch is planned; the
results equal synchronous stepping (greedy parity per family is in the parity tests)."""

from __future__ import annotations

import threading

from core.messages import SamplingParams
from llm_stage.request import RequestStatus
from tests.factories import EOS_FAKE, fake_request, fake_scheduler, orpheus_engine


def test_next_batch_is_planned_while_the_forward_runs_on_the_worker_thread():
    """Each forward waits until the engine thread has planned a batch *during* that forward; a
    synchronous engine never plans while a forward runs, so its forwards would time out."""
    engine = orpheus_engine(num_slots=4, async_steps=True)
    in_forward, planned = threading.Event(), threading.Event()
    forward_threads, overlapped = [], []
    run_forward, schedule = engine.runner.forward, engine.scheduler.schedule

    def forward(prepared):
        forward_threads.append(threading.current_thread().name)
        in_forward.set()
        overlapped.append(planned.wait(timeout=5.0))
        in_forward.clear()
        planned.clear()
        return run_forward(prepared)

    def planning():
        plan = schedule()
        if in_forward.wait(timeout=1.0):  # only plans made while a forward is in flight count
            planned.set()
        return plan

    engine.runner.forward, engine.scheduler.schedule = forward, planning
    engine.add_request("a", "hello there", None, {"max_tokens": 14, "seed": 1})
    engine.run_to_completion()
    engine.close()
    assert len(overlapped) >= 14 and all(overlapped)
    assert set(forward_threads) == {"llm-forward_0"}


def test_plan_made_ahead_drops_units_finished_or_cancelled_since():
    scheduler = fake_scheduler(num_slots=6, max_batch_size=6)
    done, gone, kept = fake_request("done", 3), fake_request("gone", 3, twin_prompt_len=2), fake_request("kept", 3)
    for req in (done, gone, kept):
        scheduler.add(req)
    first = scheduler.schedule()
    scheduler.advance(first)
    ahead = scheduler.schedule()  # made before the first step's tokens are known
    assert [r.req_id for r in ahead.decodes] == ["done", "gone", "gone#uncond", "kept"]
    scheduler.append(first, [EOS_FAKE, 7, 7])
    scheduler.cancel("gone")
    plan = scheduler.revalidate(ahead)
    assert [r.req_id for r in plan.decodes] == ["kept"]
    assert done.status is RequestStatus.FINISHED and scheduler.slots.num_free == 5


def test_seeded_sampling_with_joins_and_a_cancel_matches_synchronous_steps():
    def run(async_steps: bool) -> dict[str, list[int]]:
        engine = orpheus_engine(num_slots=4, async_steps=async_steps)
        got: dict[str, list[int]] = {}
        texts = {"a": "first voice", "b": "second, longer line of text", "c": "third", "d": "cancelled one"}
        join_at = {"a": 0, "b": 0, "c": 4, "d": 6}
        for tick in range(400):
            for req_id, at in join_at.items():
                if at == tick:
                    engine.add_request(req_id, texts[req_id], None, {"max_tokens": 28, "seed": 10 + tick})
            if tick == 15:
                engine.cancel("d")
            for out in engine.step():
                got.setdefault(out.req_id, []).extend(out.new_token_ids)
            if tick > 6 and not engine.has_work:
                break
        engine.close()
        return got

    sync, asynchronous = run(False), run(True)
    assert sync.keys() == asynchronous.keys() == {"a", "b", "c", "d"}
    for req_id in "abc":
        assert asynchronous[req_id] == sync[req_id], req_id
        assert len(sync[req_id]) == 28


def test_async_engine_honours_greedy_defaults():
    engine = orpheus_engine(num_slots=2, async_steps=True)
    engine.add_prompt("g", engine.adapter.format_prompt("hi", "tara"), SamplingParams(temperature=0.0, max_tokens=7))
    tokens = engine.run_to_completion()["g"]
    assert len(tokens) == 7 and engine.scheduler.slots.num_free == 2

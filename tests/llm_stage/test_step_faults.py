"""Accelerator faults of an engine step (`llm_stage.faults`), injected on CPU: a step that runs out
of memory fails only the requests it sheds (a prefill's new request; in a decode-only step the
newest), frees their KV slots, leaves nothing planned ahead, and every other request, and any
later one, samples the greedy tokens a fresh engine gives it."""

from __future__ import annotations

import pytest
import torch

from core.config import DetokConfig
from llm_stage.chunking import ChunkSchedule
from llm_stage.engine import LLMEngine
from llm_stage.faults import StepOutOfMemory, is_device_lost, is_out_of_memory, requests_to_shed
from llm_stage.request import RequestStatus
from llm_stage.runner import PreparedStep
from llm_stage.scheduler import StepPlan
from llm_stage.side import LLMSide
from tests.factories import fake_request, fake_scheduler, orpheus_engine

GREEDY = {"temperature": 0.0, "max_tokens": 28}
TEXTS = {"a": "the first line", "b": "a second, longer line", "c": "the third"}


def has_prompt_rows(step: PreparedStep) -> bool:
    """A forward with prompt tokens in it (a padded prompt forward, or prompt rows folded on CUDA)."""
    return step.prefill is not None or step.folded_rows is not None


def fail_once(engine: LLMEngine, when, err: Exception | None = None) -> list[bool]:
    """`engine`'s forward raises `err` (an injected OOM) once, at the first forward `when` holds
    for; the list returned gets an entry when it fired."""
    forward, fired = engine.runner.forward, []

    def forward_or_fail(step: PreparedStep) -> torch.Tensor:
        if not fired and when(step):
            fired.append(True)
            raise err or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return forward(step)

    engine.runner.forward = forward_or_fail
    return fired


def alone(req_id: str) -> list[int]:
    """`req_id`'s greedy tokens on a fresh engine with nothing else running."""
    engine = orpheus_engine(num_slots=4)
    engine.add_request(req_id, TEXTS[req_id], "tara", GREEDY)
    return engine.run_to_completion()[req_id]


def step_into(engine: LLMEngine, tokens: dict[str, list[int]], num_steps: int = 1) -> None:
    for _ in range(num_steps):
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)


def step_until_raised(engine: LLMEngine, tokens: dict[str, list[int]], max_steps: int = 12) -> StepOutOfMemory:
    with pytest.raises(StepOutOfMemory) as raised:
        step_into(engine, tokens, max_steps)  # (a start may wait a few steps for its head phase)
    return raised.value


@pytest.mark.parametrize("async_steps", [False, True])
def test_an_oom_at_a_requests_prefill_fails_that_request_and_the_running_one_goes_on(async_steps):
    engine = orpheus_engine(num_slots=4, async_steps=async_steps)
    tokens: dict[str, list[int]] = {}
    engine.add_request("a", TEXTS["a"], "tara", GREEDY)
    step_into(engine, tokens, 6)  # a decodes
    fired = fail_once(engine, has_prompt_rows)
    engine.add_request("b", TEXTS["b"], "tara", GREEDY)
    err = step_until_raised(engine, tokens)
    assert fired and err.req_ids == ["b"] and "out of accelerator memory" in str(err)
    assert "b" not in engine.requests and "b" not in tokens  # gone, KV slot included
    assert engine.scheduler.slots.num_used == 1 and list(engine.scheduler.running) == ["a"]
    assert engine._next_plan is None  # nothing planned ahead with the failed step's positions
    while engine.has_work:
        step_into(engine, tokens)
    assert tokens["a"] == alone("a")  # its failed step ran again: the same tokens as never failed
    engine.add_request("c", TEXTS["c"], "tara", GREEDY)
    assert engine.run_to_completion()["c"] == alone("c")  # the replica serves the next request alike
    assert engine.scheduler.slots.num_used == 0 and not engine.requests
    engine.close()


@pytest.mark.parametrize("async_steps", [False, True])
def test_an_oom_in_a_decode_step_sheds_the_newest_request(async_steps):
    engine = orpheus_engine(num_slots=4, async_steps=async_steps)
    tokens: dict[str, list[int]] = {}
    engine.add_request("a", TEXTS["a"], "tara", GREEDY)
    step_into(engine, tokens, 2)
    engine.add_request("b", TEXTS["b"], "tara", GREEDY)
    step_into(engine, tokens, 10)  # both decode
    assert all(r.status is RequestStatus.DECODING for r in engine.requests.values())
    fail_once(engine, lambda step: not has_prompt_rows(step))
    assert step_until_raised(engine, tokens).req_ids == ["b"]
    assert engine.scheduler.slots.num_used == 1
    while engine.has_work:
        step_into(engine, tokens)
    assert tokens["a"] == alone("a")
    engine.close()


def test_the_side_drops_a_shed_request_and_keeps_cutting_the_others_chunks():
    engine = orpheus_engine(num_slots=4)
    side = LLMSide(engine, ChunkSchedule.from_config(DetokConfig(first_chunk_frames=1)))
    side.add(engine.job("a", TEXTS["a"], "tara", GREEDY))
    for _ in range(4):
        side.step()
    fail_once(engine, has_prompt_rows)
    side.add(engine.job("b", TEXTS["b"], "tara", GREEDY))
    with pytest.raises(StepOutOfMemory):
        for _ in range(12):
            side.step()
    assert set(side.chunkers) == {"a"} and set(side.num_checkpointed) == {"a"}
    chunks = [chunk for _ in range(40) for chunk in side.step()]
    assert {c.req_id for c in chunks} == {"a"} and chunks[-1].is_final


def test_a_failed_step_that_is_no_oom_leaves_the_scheduler_as_before_it():
    """(Async steps: the positions marked cached during the forward are unmarked again.)"""
    engine = orpheus_engine(num_slots=4, async_steps=True)
    engine.add_request("a", TEXTS["a"], "tara", GREEDY)
    tokens: dict[str, list[int]] = {}
    step_into(engine, tokens, 5)
    [req] = engine.requests.values()
    cached = req.num_cached
    fail_once(engine, lambda step: True, ValueError("a bug in the forward"))
    with pytest.raises(ValueError):
        step_into(engine, tokens)
    assert req.num_cached == cached and engine._next_plan is None and "a" in engine.requests
    while engine.has_work:
        step_into(engine, tokens)
    assert tokens["a"] == alone("a")


def test_retreat_undoes_advance():
    scheduler = fake_scheduler(num_slots=4, max_batch_size=4)
    running, guided = fake_request("run", 3), fake_request("cfg", 6, twin_prompt_len=4)
    scheduler.add(running)
    scheduler.update(scheduler.schedule(), [7])  # `run` decodes
    scheduler.add(guided)
    plan = scheduler.schedule()  # run's decode, and each cfg row's whole prompt
    before = [(r.num_cached, r.status) for r in (running, guided, guided.twin)]
    scheduler.advance(plan)
    scheduler.retreat(plan)
    assert [(r.num_cached, r.status) for r in (running, guided, guided.twin)] == before
    again = scheduler.schedule()
    assert again.decodes == plan.decodes and again.prefills == plan.prefills
    assert requests_to_shed(plan, [running, guided]) == [guided]  # the guided request, never its twin
    assert requests_to_shed(StepPlan(plan.decodes), [running, guided]) == [running]


def test_device_errors_are_told_apart_from_out_of_memory():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
    assert is_out_of_memory(oom) and is_out_of_memory(StepOutOfMemory(["r"], oom)) and not is_device_lost(oom)
    lost = [
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`"),
    ]
    assert all(is_device_lost(err) and not is_out_of_memory(err) for err in lost)
    refused = torch.AcceleratorError("CUDA error: out of memory")  # an allocation refused, context intact
    assert is_out_of_memory(refused) and not is_device_lost(refused)
    assert not any(is_device_lost(err) for err in (ValueError("CUDA error"), RuntimeError("shape mismatch")))

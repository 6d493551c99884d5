"""The stages' answer to an out-of-memory step, without Serve: the LLM replica fails only the streams
the step shed, each with the Failed event the Router answers RESOURCE_EXHAUSTED with a retry hint;
a detok replica's out-of-memory reaches the LLM replica typed, through the Ray error. (Device loss:
tests/deployments/test_engine_loop.py; the real path: tests/deployments/test_zz_gpu_faults.py.)"""

from __future__ import annotations

import asyncio

import torch
from ray.exceptions import RayTaskError

from core.config import ServeConfig
from core.messages import Failed
from deployments.detok_stage import DetokStage
from deployments.llm_stage import LLMStage, _Stream
from llm_stage.faults import StepOutOfMemory
from router.replies import out_of_memory_message, out_of_memory_retry_s

OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def bare_llm_stage(req_ids: list[str]) -> LLMStage:
    stage = object.__new__(LLMStage)  # only the failure path under test: no engine, no Serve
    stage.config, stage.num_out_of_memory = ServeConfig(), 0
    stage.streams = {req_id: _Stream(asyncio.Queue()) for req_id in req_ids}
    stage.event_loop = asyncio.get_running_loop()
    return stage


def test_an_out_of_memory_step_fails_only_the_streams_it_shed():
    async def run() -> None:
        stage = bare_llm_stage(["a", "b"])
        stage._on_step_error(StepOutOfMemory(["b"], OOM))  # (called on the engine thread)
        await asyncio.sleep(0.01)
        events = [event async for event in stage._audio(stage.streams["b"])]
        retry_after_s = stage.config.admission.retry_after_s
        assert events == [Failed(out_of_memory_message(retry_after_s))]
        assert out_of_memory_retry_s(events[0].message) == retry_after_s
        assert stage.streams["a"].queue.empty() and stage.num_out_of_memory == 1

    asyncio.run(run())


def test_a_detok_replicas_out_of_memory_fails_its_streams_as_out_of_memory():
    async def failure_seen_by_the_llm_replica() -> Failed:
        detok = object.__new__(DetokStage)  # only `_fail_all`: no engine, no Serve
        waiter = asyncio.get_running_loop().create_future()
        detok.waiters = {("a", 0): waiter}
        detok._fail_all(OOM)
        try:
            await waiter
        except torch.OutOfMemoryError as err:  # as the replica's decode_batch raises it to its caller
            wrapped = RayTaskError("decode_batch", "traceback", err).as_instanceof_cause()
        assert not detok.waiters
        return bare_llm_stage([])._failed("detokenizer", wrapped)

    failed = asyncio.run(failure_seen_by_the_llm_replica())
    assert out_of_memory_retry_s(failed.message) == ServeConfig().admission.retry_after_s


def test_other_failures_stay_internal():
    async def run() -> Failed:
        return bare_llm_stage([])._failed("detokenizer", RuntimeError("detokenizer failed: KeyError"))

    failed = asyncio.run(run())
    assert failed.message.startswith("detokenizer failed") and out_of_memory_retry_s(failed.message) is None

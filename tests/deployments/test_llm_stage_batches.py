"""LLMStage's step batches (`_Batch`): the last stream to leave cancels the decode call, even one
not sent yet."""

from __future__ import annotations

import asyncio

from deployments.llm_stage import _Batch


class _Response:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_only_the_last_stream_leaving_cancels_the_call():
    async def run() -> None:
        batch = _Batch(
            chunks=[], num_waiting=2, response=_Response(), result=asyncio.get_running_loop().create_future()
        )
        batch.release()
        assert not batch.response.cancelled and not batch.result.cancelled()
        batch.release()
        assert batch.response.cancelled and batch.result.cancelled()

    asyncio.run(run())


def test_a_batch_left_before_its_call_was_sent_cancels_cleanly():
    async def run() -> None:
        batch = _Batch(chunks=[], num_waiting=1, result=asyncio.get_running_loop().create_future())
        batch.release()  # response is still None: the decode task has not run yet
        assert batch.result.cancelled()

    asyncio.run(run())

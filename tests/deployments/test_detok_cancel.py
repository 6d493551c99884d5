"""DetokStage.decode_batch cancelled while its chunk is still being submitted: nothing stays behind."""

from __future__ import annotations

import asyncio
import time

import pytest

from core.config import ServeConfig
from core.messages import TokenChunk
from deployments.detok_stage import DetokStage


def test_cancel_during_submit_leaves_no_chunk_or_waiter_behind():
    stage = DetokStage(ServeConfig().model_dump(mode="json"))
    stage.loop.stop()  # no engine steps: whatever the submit leaves behind stays visible
    real_submit = stage._submit

    def slow_submit(*args) -> None:
        time.sleep(0.2)  # the cancel lands while this thread is still submitting
        real_submit(*args)

    stage._submit = slow_submit
    chunk = TokenChunk("gone", 0, [[1] * 7, [2] * 7], 0, 0, 2, False)

    async def cancel_mid_submit() -> None:
        task = asyncio.ensure_future(stage.decode_batch([chunk]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)  # past the submit thread either way

    asyncio.run(cancel_mid_submit())
    assert stage.waiters == {}
    assert not stage.engine.has_work and stage.engine.num_requests == 0

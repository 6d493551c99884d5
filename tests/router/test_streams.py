"""RouterCore's wait for a stream's head (router.streams.first_event), with a stream that behaves
like Serve's response generator: a cancelled read ends with an error of its own, not CancelledError."""

from __future__ import annotations

import asyncio
import gc

import pytest

from router.streams import first_event


class ServeLikeStream:
    """Never yields; a cancelled read raises, as Serve's RequestCancelledError does."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()

    def __aiter__(self) -> ServeLikeStream:
        return self

    async def __anext__(self) -> object:
        self.reading.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("request was cancelled") from None


async def _unobserved_errors_after(give_up) -> list[str]:
    """Messages the loop reports for task errors nobody retrieved, after `give_up` ends a wait."""
    errors: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context["message"]))
    await give_up()
    for _ in range(3):  # the read task finishes
        await asyncio.sleep(0)
    gc.collect()  # an unobserved task error is reported when the task is collected
    return errors


def test_a_client_gone_while_waiting_for_the_head_leaves_no_unobserved_error():
    async def give_up() -> None:
        stream = ServeLikeStream()
        waiting = asyncio.ensure_future(first_event(stream, lambda: False))
        await stream.reading.wait()
        waiting.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await waiting

    assert asyncio.run(_unobserved_errors_after(give_up)) == []


def test_no_replica_left_gives_none_and_leaves_no_unobserved_error():
    async def give_up() -> None:
        lost = asyncio.Event()
        stream = ServeLikeStream()
        waiting = asyncio.ensure_future(first_event(stream, lost.is_set, poll_s=0.01))
        await stream.reading.wait()
        lost.set()
        assert await waiting is None

    assert asyncio.run(_unobserved_errors_after(give_up)) == []


def test_the_outage_clock_gives_a_resumed_stream_its_wait_and_a_new_one_none(monkeypatch):
    """No replica listed: over at once without a wait; with one, only once the outage has lasted it,
    and a replica listed meanwhile (the replacement) restarts the clock."""
    import router.streams as streams

    now = [100.0]
    live: list[int | None] = [0]
    monkeypatch.setattr(streams.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(streams, "num_live_replicas", lambda app_name: live[0])
    assert streams.OutageClock("app", 0.0, "new").is_over()
    resumed = streams.OutageClock("app", 30.0, "resumed")
    assert not resumed.is_over()
    now[0] += 29.0
    assert not resumed.is_over()
    live[0] = 1  # the replacement is listed: the clock restarts
    assert not resumed.is_over()
    live[0] = 0
    now[0] += 29.0
    assert not resumed.is_over()
    now[0] += 30.0
    assert resumed.is_over()
    live[0] = None  # before Serve has lost any replica: never an outage
    assert not streams.OutageClock("app", 0.0, "new").is_over()

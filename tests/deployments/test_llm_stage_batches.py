"""LLMStage's step batches: one decode call carries a step's chunks of every stream, each stream
gets its share in seq order, and the last stream to leave cancels the call (even one not sent yet).
The detok handle here records calls; the real path is covered by tests/deployments/test_cluster.py."""

from __future__ import annotations

import asyncio
import gc
import time
from types import SimpleNamespace

import pytest

from core.messages import TokenChunk
from core.policy import StepTimer
from deployments.llm_stage import LLMStage, _Batch, _Stream


class _Response:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return []


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


class _RecordingDetok:
    """Stands in for the DetokStage handle: records each decode_batch call's chunks."""

    def __init__(self) -> None:
        self.calls: list[list[TokenChunk]] = []
        self.targets: list[str] = []
        self.decode_batch = self

    def remote(self, chunks: list[TokenChunk], to_replica: str = "") -> _Response:
        self.calls.append(chunks)
        self.targets.append(to_replica)
        return _Response()


def test_one_call_carries_a_steps_chunks_of_every_live_stream():
    async def run() -> None:
        stage = object.__new__(LLMStage)  # only the hand-off under test: no engine, no Serve
        stage.detok, stage.num_decode_calls, stage.detok_pins = _RecordingDetok(), 0, None
        stage.streams = {rid: _Stream(asyncio.Queue()) for rid in ("a", "b")}
        stage.side = SimpleNamespace(engine=SimpleNamespace(timer=StepTimer()))
        chunks = [
            TokenChunk(rid, seq, [[0] * 7], 0, 0, 1, False) for rid, seq in (("a", 0), ("b", 0), ("a", 1), ("gone", 0))
        ]
        stage._send(chunks, {})  # (req_id, seq) -> Checkpoint: none in this step
        await asyncio.sleep(0.01)  # the batch's decode task sends the call
        assert [[(c.req_id, c.seq) for c in call] for call in stage.detok.calls] == [[("a", 0), ("b", 0), ("a", 1)]]
        a, b = stage.streams["a"].queue, stage.streams["b"].queue
        assert [a.get_nowait()[1], a.get_nowait()[1], b.get_nowait()[1]] == [0, 2, 1]  # indexes into the call
        assert stage.streams["a"].pending[0] is stage.streams["b"].pending[0]  # one shared batch
        assert stage.streams["a"].pending[0].num_waiting == 2

    asyncio.run(run())


def test_the_last_stream_leaving_leaves_no_unobserved_error():
    """Serve turns the call's cancel into RequestCancelledError; nobody awaits the batch any more,
    so the batch consumes it (an unobserved task error was logged with a traceback)."""

    async def decoded_until_cancelled() -> list:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("request was cancelled") from None
        return []

    async def run() -> list[str]:
        errors: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context["message"]))
        batch = _Batch(chunks=[], num_waiting=1, response=_Response())
        batch.result = asyncio.ensure_future(decoded_until_cancelled())
        await asyncio.sleep(0)  # the call is under way
        batch.release()
        for _ in range(3):
            await asyncio.sleep(0)
        del batch
        gc.collect()
        return errors

    assert asyncio.run(run()) == []


def test_a_stateful_detokenizers_streams_go_each_to_its_pinned_replica(monkeypatch):
    """One call per detok replica per step, each stream's chunks always to the same replica."""
    import deployments.llm_stage as llm_stage_module
    from router.detok_pins import DetokPins

    monkeypatch.setattr(llm_stage_module, "live_detok_replicas", lambda app: {"d1": 0, "d2": 0})

    async def run() -> None:
        stage = object.__new__(LLMStage)
        stage.detok, stage.num_decode_calls, stage.detok_pins = _RecordingDetok(), 0, DetokPins()
        stage.config, stage.detok_scope = SimpleNamespace(app_name="app"), "app"  # its detok deployment's board
        stage.streams = {rid: _Stream(asyncio.Queue()) for rid in ("a", "b", "c")}
        stage.side = SimpleNamespace(engine=SimpleNamespace(timer=StepTimer()))
        for seq in range(3):
            stage._send([TokenChunk(rid, seq, [[0] * 7], 0, 0, 1, False) for rid in ("a", "b", "c")], {})
        await asyncio.sleep(0.01)
        by_replica: dict[str, set[str]] = {}
        for target, call in zip(stage.detok.targets, stage.detok.calls, strict=True):
            by_replica.setdefault(target, set()).update(c.req_id for c in call)
        assert len(stage.detok.calls) == 6  # two replicas, three steps
        assert sorted(map(len, by_replica.values())) == [1, 2] and set(by_replica) == {"d1", "d2"}
        assert not by_replica["d1"] & by_replica["d2"]  # no stream on both

    asyncio.run(run())


def test_a_stream_follows_its_decoder_state_only_when_its_pinned_replica_was_passed_by():
    from core.messages import AudioRef
    from router.detok_pins import DetokPins

    stage = object.__new__(LLMStage)
    stage.detok_pins, stage.streams = DetokPins(), {"a": None, "b": None}
    stage.detok_pins.target("a", {"d2": 0})

    def ref(req_id: str, replica: str) -> AudioRef:
        return AudioRef(req_id, 0, False, 0.1, 1, None, TokenChunk(req_id, 0, [[0]], 0, 0, 1, False), 0, replica)

    stage._follow_decoder_state("", [ref("a", "DetokStage#d1"), ref("b", "DetokStage#d1")])  # sent unpinned
    assert stage.detok_pins.by_stream == {"a": "d2", "b": "d1"}  # a stays where its later chunks went
    stage._follow_decoder_state("d2", [ref("a", "DetokStage#d3")])  # d2 was gone: d3 decoded it
    assert stage.detok_pins.by_stream["a"] == "d3"


def test_queued_streams_wait_outside_the_engine_until_the_pace_has_room_first_come_first():
    """`admission.decide` queued them: they start when a running stream ends under the paced limit
    (here 2 streams, the KV cap 8), not when the engine has a free KV slot (it has 6); one that
    would start after its TTFA deadline is refused instead."""
    from router.admission import ReplicaLoad

    async def run() -> None:
        stage = object.__new__(LLMStage)
        stage.is_moving_out, stage.held, stage.room_changed = False, [], None
        stage.streams = {rid: _Stream(asyncio.Queue()) for rid in ("run-1", "run-2")}
        paced = dict(max_streams=8, max_queued=4, step_s=0.01, first_chunk_tokens=7, avg_stream_s=1.0)
        paced |= dict(real_time_streams=3.0, measured_streams=3)  # limit floor(0.85 x 3) = 2
        stage.load = lambda: ReplicaLoad(num_active=len(stage.streams), **paced)
        started: list[str] = []

        async def queued(rid: str, within_s: float = 60.0) -> None:
            stage.streams[rid] = stream = _Stream(asyncio.Queue())
            if await stage._hold(stream, time.monotonic() + within_s):
                started.append(rid)
            else:
                stage.streams.pop(rid)  # refused: it would have started after its TTFA deadline

        waiting = [asyncio.ensure_future(queued(rid)) for rid in ("q-1", "q-2")]
        await asyncio.sleep(0.1)
        assert started == [] and len(stage.held) == 2  # 2 running: the limit
        del stage.streams["run-1"]  # a running stream ends (`_close`: the held ones look again)
        stage._wake_held()
        await asyncio.sleep(0.1)
        assert started == ["q-1"] and len(stage.held) == 1
        late = asyncio.ensure_future(queued("q-late", within_s=0.1))  # behind q-2, no room in time
        await asyncio.sleep(0.2)
        assert late.done() and "q-late" not in started and len(stage.held) == 1
        del stage.streams["run-2"]
        stage._wake_held()
        await asyncio.wait_for(asyncio.gather(*waiting), 0.2)  # woken, not found by the periodic look
        assert started == ["q-1", "q-2"] and not stage.held

    asyncio.run(run())


def test_queued_streams_wait_for_the_streams_starting_ahead_of_them():
    """Under the paced limit but at the startup limit (here 1): a queued stream starts once the
    stream starting ahead of it has sent STARTUP_CHUNKS chunks, not before."""
    from router.admission import STARTUP_CHUNKS, ReplicaLoad, StartTimes

    async def run() -> None:
        stage = object.__new__(LLMStage)
        stage.is_moving_out, stage.held, stage.room_changed = False, [], None
        stage.start_times = StartTimes()
        stage.streams = {"run-1": _Stream(asyncio.Queue())}
        room = dict(max_streams=8, max_queued=4, step_s=0.01, first_chunk_tokens=7, avg_stream_s=1.0, startup_limit=1)
        stage.load = lambda: ReplicaLoad(
            num_active=len(stage.streams), num_starting=sum(s.is_starting for s in stage.streams.values()), **room
        )
        stage.streams["q-1"] = queued = _Stream(asyncio.Queue())
        hold = asyncio.ensure_future(stage._hold(queued, time.monotonic() + 60.0))
        for _ in range(STARTUP_CHUNKS):
            await asyncio.sleep(0.1)
            assert not hold.done()  # run-1 is still starting
            stage._count_chunk(stage.streams["run-1"])  # its chunk sent (the last one ends its start)
        assert await asyncio.wait_for(hold, 0.1) and queued.is_starting  # woken at once

    asyncio.run(run())


def test_a_replica_reports_the_most_each_running_stream_has_left_soonest_first():
    """`ends_in_s` (router.admission): a stream in the engine has its steps to max_tokens at the
    measured step, and its last decode, left; one whose engine part is over, its decodes only; a
    held one none (it is not running); one not in the engine yet, a mean lifetime."""
    import dataclasses

    import pytest

    from core.config import EngineConfig, ModelConfig
    from core.messages import SamplingParams
    from llm_stage.jobs import build_job
    from llm_stage.wiring import build_llm_side

    stage = object.__new__(LLMStage)
    stage.side = build_llm_side(EngineConfig(model=ModelConfig(name="orpheus-tiny", torch_threads=1)))
    adapter, timer = stage.side.engine.adapter, stage.side.engine.timer
    for req_id, max_tokens in (("long", 300), ("short", 40)):
        job = build_job(adapter, text="Hello there.", req_id=req_id)
        stage.side.add(dataclasses.replace(job, sampling=SamplingParams(max_tokens=max_tokens, seed=1)))
    for _ in range(5):
        stage.side.step()
    timer._decode_step_s, stage.avg_stream_s = 0.01, 3.0  # the steady step (`StepTimer.steady_step_s`)
    stage.streams = {rid: _Stream(asyncio.Queue()) for rid in ("long", "short", "held", "adding", "ended")}
    stage.streams["held"].is_held = True
    stage.streams["ended"].num_chunks = 3  # finished in the engine, its last chunk's audio on the way
    short_left = 40 - len(stage.side.engine.requests["short"].output_ids)
    long_left = 300 - len(stage.side.engine.requests["long"].output_ids)
    expected = (0.05, short_left * 0.01 + 0.05, 3.0, long_left * 0.01 + 0.05)
    assert stage._ends_in_s(decode_s=0.05) == pytest.approx(expected)


def test_only_new_streams_measure_start_times():
    """A resumed or moved-in stream's first chunk (a long re-prefill, or none at all) says nothing of
    a new stream's wait: the start times admission predicts from leave it out."""
    from router.admission import StartTimes

    stage = object.__new__(LLMStage)
    stage.start_times, stage.held, stage.room_changed = StartTimes(), [], None
    resumed = _Stream(asyncio.Queue(), is_new=False)
    resumed.started_s = resumed.arrived_s = time.monotonic() - 30.0
    stage._count_chunk(resumed)
    assert stage.start_times.first_chunk_s() == stage.start_times.ttfa_s() == 0.0
    new = _Stream(asyncio.Queue())
    new.arrived_s, new.started_s = time.monotonic() - 1.0, time.monotonic() - 0.25  # held 0.75 s first
    stage._count_chunk(new)
    assert stage.start_times.first_chunk_s() == pytest.approx(0.25, abs=0.05)
    assert stage.start_times.ttfa_s() == pytest.approx(1.0, abs=0.05)


def test_speech_in_text_reaches_live_streams_in_order_with_their_chunks():
    """A step's text deltas go to their streams' queues (a stream gone gets none) and `_audio` yields
    them as they come, without waiting for audio."""
    from core.messages import Failed, TextDelta

    async def run() -> list:
        stage = object.__new__(LLMStage)
        stage.streams = {"a": _Stream(asyncio.Queue())}
        stage._send_text([TextDelta("a", "Hel"), TextDelta("gone", "x"), TextDelta("a", "lo")])
        stage.streams["a"].queue.put_nowait(RuntimeError("engine stopped"))  # ends the stream after the text
        return [event async for event in stage._audio(stage.streams["a"])]

    events = asyncio.run(run())
    assert [e.text for e in events[:2]] == ["Hel", "lo"] and isinstance(events[2], Failed)

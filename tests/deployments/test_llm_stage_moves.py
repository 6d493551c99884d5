"""LLMStage handing streams off: asked to rebalance, it moves the streams cheapest to move (fewest
generated tokens), never a streaming-text one, with `Moved(is_leaving=False)`; asked to leave, all
of them. The side and engine here are stand-ins; the real path is tests/deployments/test_zz_rebalance.py."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

from core.messages import Moved, ResumeState
from deployments.llm_stage import LLMStage, _Stream


class _Side:
    """The engine's requests (tokens generated, text feed) and the `move_out` LLMSide answers with."""

    def __init__(self, tokens: dict[str, int], text_streaming: set[str]) -> None:
        requests = {rid: SimpleNamespace(output_ids=[0] * n, text_feed=object() if rid in text_streaming else None)
                    for rid, n in tokens.items()}  # fmt: skip
        self.engine = SimpleNamespace(requests=requests)
        self.chunkers = dict.fromkeys(tokens)
        self.moved: list[str] = []

    def move_out(self, req_id: str) -> tuple[ResumeState, None]:
        self.moved.append(req_id)
        del self.engine.requests[req_id], self.chunkers[req_id]
        return ResumeState((), 0, 0), None


def _stage(tokens: dict[str, int], text_streaming: set[str] = frozenset()) -> LLMStage:
    stage = object.__new__(LLMStage)  # only the hand-off under test: no engine, no Serve
    stage.side = _Side(tokens, set(text_streaming))
    stage.streams = {rid: _Stream(asyncio.Queue()) for rid in [*tokens, "being-added"]}  # not in the engine yet
    stage.loop = SimpleNamespace(exclusive=contextlib.nullcontext, stop=lambda: None)
    stage.replica_tag, stage.kv_moves = "LLMStage#busy", None  # (no KV here: the side moves none)
    stage.num_moved_out = stage.num_rebalanced_out = 0
    stage.detok_pins = None  # a stateless codec's streams are not pinned
    return stage


def _moved_events(stage: LLMStage) -> dict[str, Moved]:
    return {rid: s.queue.get_nowait() for rid, s in stage.streams.items() if not s.queue.empty()}


def test_rebalancing_moves_the_fewest_tokens_first_and_never_a_streaming_text_one():
    stage = _stage({"long": 900, "typed": 5, "short": 40, "mid": 300}, text_streaming={"typed"})
    assert stage._movable_streams(limit=9) == ["short", "mid", "long"]

    async def run() -> dict[str, Moved]:
        stage.event_loop = asyncio.get_running_loop()
        stage._move_streams_out(limit=2, is_leaving=False)
        await asyncio.sleep(0)  # the Moved events reach the streams' queues on the loop
        return _moved_events(stage)

    events = asyncio.run(run())
    assert stage.side.moved == ["short", "mid"] and sorted(events) == ["mid", "short"]
    assert all(event.is_leaving is False and event.llm_replica == "LLMStage#busy" for event in events.values())
    assert (stage.num_rebalanced_out, stage.num_moved_out) == (2, 0)


def test_leaving_moves_every_stream_it_can():
    stage = _stage({"a": 10, "b": 20, "typed": 5}, text_streaming={"typed"})
    events = _leave(stage)
    assert sorted(events) == ["a", "b"] and all(event.is_leaving for event in events.values())
    assert (stage.num_rebalanced_out, stage.num_moved_out) == (0, 2)


def _leave(stage: LLMStage) -> dict[str, Moved]:
    """Ask `stage` to leave; the Moved event each stream got."""

    async def run() -> dict[str, Moved]:
        stage.event_loop = asyncio.get_running_loop()
        stage.side.move_out = _refusing_text_streams(stage.side)
        stage._move_streams_out()
        await asyncio.sleep(0)
        return _moved_events(stage)

    return asyncio.run(run())


def _refusing_text_streams(side: _Side):
    """LLMSide.move_out's answer for a streaming-text request or one not in the engine: None."""
    move_out = side.move_out

    def refusing(req_id: str):
        req = side.engine.requests.get(req_id)
        return None if req is None or req.text_feed is not None else move_out(req_id)

    return refusing


def test_a_moved_stream_names_the_detok_replica_holding_its_decoder_state():
    """A stateful detokenizer's stream hands its pinned detok replica on with its state; the
    replica continuing it pins it to the same one while that one lives (never re-placing it)."""
    from router.detok_pins import DetokPins

    stage = _stage({"a": 10, "b": 20})
    stage.detok_pins = DetokPins({"a": "x"})  # pins hold the replicas' unique ids
    events = _leave(stage)
    assert events["a"].resume.detok_replica == "x" and events["b"].resume.detok_replica == ""
    taker = DetokPins()
    taker.decoded_on("a", events["a"].resume.detok_replica)  # what LLMStage does with a resumed job
    taker.decoded_on("c", "DetokStage#x")  # a crashed replica's stream: the tag its last AudioRef named
    live = {"x": 9, "y": 0}  # y is idler, yet a's and c's states are on x (live_detok_replicas: unique ids)
    assert taker.target("a", live) == "x" and taker.target("c", live) == "x" and taker.target("b", live) == "y"

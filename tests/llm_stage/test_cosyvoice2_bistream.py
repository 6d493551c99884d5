"""CosyVoice 2 native text streaming (bistream) against the reference's `Qwen2LM.inference_bistream`
(golden tokens written by tests/data/make_cosyvoice2_bistream_golden.py on cosyvoice2-tiny): the
same greedy tokens whether the text comes whole or piece by piece while the stream runs, batched
beside other streams and a whole-text request; the whole-text path is untouched."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from core.messages import SamplingParams
from core.voices import VoicePrompt, voice_id_for
from llm_stage.engine import LLMEngine
from llm_stage.models.cosyvoice2 import CosyVoice2Adapter, Kind
from llm_stage.models.cosyvoice2_bistream import FILL_TOKEN, BistreamFeed
from llm_stage.request import Request
from llm_stage.text_feed import split_whole
from tests.factories import STEP_MODES, adapter_engine, cosyvoice2_adapter

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "cosyvoice2_bistream_golden.json"


@functools.cache
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def adapter() -> CosyVoice2Adapter:
    found = cosyvoice2_adapter(golden()["seed"])
    for case in golden()["cases"]:
        found.add_voice_prompt(VoicePrompt(voice_id(case), case["prompt_text"], tuple(case["prompt_speech"])))
    return found


def voice_id(case: dict) -> str | None:
    return voice_id_for("cosyvoice2-tiny", case["name"].encode(), 24_000, "") if case["prompt_speech"] else None


def add_stream(eng: LLMEngine, case: dict, first_piece: str) -> Request:
    job = eng.job(case["name"], first_piece, voice_id(case))
    greedy = SamplingParams(temperature=0.0, max_tokens=case["num_tokens"])
    return eng.add_job(dataclasses.replace(job, sampling=greedy, text_streaming=True))


def pieces(text: str, sizes: tuple[int, ...]) -> list[str]:
    """`text` cut into pieces of the given sizes, cycled."""
    out, start, i = [], 0, 0
    while start < len(text):
        out.append(text[start : start + sizes[i % len(sizes)]])
        start, i = start + sizes[i % len(sizes)], i + 1
    return out


def run(eng: LLMEngine, schedule: dict[str, list[tuple[int, str, bool]]], max_steps: int = 2000) -> dict:
    """Step `eng`; at step s push each (s, text, end) of `schedule[req_id]`; collect tokens."""
    got: dict[str, list[int]] = {}
    for step in range(max_steps):
        for req_id, pushes in schedule.items():
            for at, text, end in pushes:
                if at == step:
                    assert eng.push_text(req_id, text, end=end)
        for out in eng.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
        if step > max(at for pushes in schedule.values() for at, _, _ in pushes) and not eng.has_work:
            break
    return got


@pytest.mark.parametrize("async_steps", [False, True])
def test_text_pushed_whole_gives_the_reference_tokens(async_steps):
    eng = adapter_engine(adapter(), num_slots=6, max_seq_len=512, prefill_token_budget=16, async_steps=async_steps)
    schedule = {}
    for case in golden()["cases"]:
        add_stream(eng, case, case["text"])
        schedule[case["name"]] = [(0, "", True)]
    got = run(eng, schedule)
    for case in golden()["cases"]:
        assert got[case["name"]] == case["tokens"], case["name"]


@pytest.mark.parametrize(("async_steps", "kv_layout"), STEP_MODES, indirect=["kv_layout"])
def test_text_pushed_piece_by_piece_while_streams_run_gives_the_same_tokens(async_steps, kv_layout):
    """Pieces of 1-7 characters every few steps (the streams wait for text between them), beside a
    whole-text request whose tokens stay those of the whole-text path."""
    eng = adapter_engine(adapter(), num_slots=6, max_seq_len=512, prefill_token_budget=16, async_steps=async_steps)
    schedule: dict[str, list[tuple[int, str, bool]]] = {}
    for n, case in enumerate(golden()["cases"]):
        first, *rest = pieces(case["text"], (1, 3, 7, 2))
        add_stream(eng, case, first)
        every = 3 + 4 * n  # steps between pieces: faster and slower than the speech
        schedule[case["name"]] = [(every * (i + 1), piece, i == len(rest) - 1) for i, piece in enumerate(rest)]
        if not rest:
            schedule[case["name"]] = [(every, "", True)]
    whole = SamplingParams(temperature=0.0, max_tokens=30)
    eng.add_prompt("whole", adapter().voice_prompt("hello world"), whole)
    got = run(eng, schedule)
    for case in golden()["cases"]:
        assert got[case["name"]] == case["tokens"], case["name"]
    alone = adapter_engine(adapter(), num_slots=1)
    alone.add_prompt("whole", adapter().voice_prompt("hello world"), whole)
    assert got["whole"] == alone.run_to_completion()["whole"]


@pytest.mark.parametrize("preempted", [False, True])
def test_a_stream_waits_for_a_text_group_holding_its_slot_then_continues(preempted):
    eng = adapter_engine(adapter(), num_slots=2)
    case = golden()["cases"][0]  # no voice: the first group needs 5 text ids
    req = add_stream(eng, case, case["text"][:4])
    assert req.is_waiting_for_text and not eng.has_work and eng.step() == []
    eng.push_text(case["name"], case["text"][4:9])  # 9 ids: one group, 4 left over
    got = []
    while eng.has_work:
        got += [t for out in eng.step() for t in out.new_token_ids]
    assert got == case["tokens"][:15]  # the group's 15 tokens, then the fill: it waits again
    assert req.is_waiting_for_text and req.slot is not None and eng.scheduler.num_waiting_for_text == 1
    if preempted:  # prefilled again, it still waits: the position that drew the fill draws nothing more
        assert eng.scheduler.preempt(case["name"]) and eng.step() == [] and req.is_waiting_for_text
    eng.push_text(case["name"], case["text"][9:], end=True)
    got += [t for t in eng.run_to_completion()[case["name"]]]
    assert got == case["tokens"]


def test_layout_follows_the_published_mix_fill_and_end():
    """Positions: sos, 5 text, 15 speech; the fill is no position (the next 5 text follow the 15th
    speech token); at the end the last fill's forward span (the 15th speech token) again, the text
    left and task_id."""
    feed = BistreamFeed.open(split_whole(lambda text: [ord(c) for c in text]), [], [])
    req = Request("r", [(0, Kind.LLM)], SamplingParams(), text_feed=feed)
    feed.push("abcdefg")
    feed.lay_out(req)
    text = [(ord(c), Kind.TEXT) for c in "abcdefg"]
    assert req.positions == text[:5] and feed.ready_through > 6
    req.num_cached = 6  # prompt + group computed: draws 15 speech tokens, then the forced fill
    for token in range(100, 115):
        assert not feed.forces_fill
        feed.take_token(req, token)
        req.num_cached = req.num_known - 1
    req.num_cached += 1  # the 15th speech token is computed, drawing the fill
    assert feed.forces_fill
    feed.take_token(req, FILL_TOKEN)
    assert req.output_ids == list(range(100, 115)) and req.is_waiting_for_text  # 2 ids: not a group
    assert adapter().drawn_ids(req, 0) == [*range(100, 115), FILL_TOKEN]  # RAS looks back on fills too
    feed.end()
    feed.lay_out(req)
    assert req.positions[20:] == [114, *text[5:], (1, Kind.LLM)] and not req.is_waiting_for_text

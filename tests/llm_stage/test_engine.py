"""Engine lifecycle: KV memory, slot release on finish/cancel, bad input, stop conditions."""

from __future__ import annotations

import pytest

from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from llm_stage.models.orpheus import AUDIO_TOKEN_BASE, CODES_PER_SLOT, END_OF_SPEECH
from tests.factories import orpheus_engine, text_engine, tiny_text_llama


def test_kv_memory_flat_over_1000_decode_steps_and_slots_released():
    engine = text_engine(tiny_text_llama(), num_slots=4, max_seq_len=1100)
    cache = engine.runner.cache
    before = (cache.keys.data_ptr(), cache.num_bytes)
    engine.add_prompt("long", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1000))
    engine.add_prompt("short", [1, 9], SamplingParams(temperature=0.0, max_tokens=5))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert (cache.keys.data_ptr(), cache.num_bytes) == before
    assert steps >= 1000
    assert engine.scheduler.slots.num_free == 4
    assert not engine.requests


def test_cancel_frees_slot_and_others_continue():
    engine = text_engine(tiny_text_llama(), num_slots=2)
    params = SamplingParams(temperature=0.0, max_tokens=30)
    for req_id in ("a", "b", "c"):
        engine.add_prompt(req_id, [1, 4, 5], params)
    for _ in range(3):
        engine.step()
    assert engine.scheduler.slots.num_free == 0 and len(engine.scheduler.waiting) == 1
    assert engine.cancel("a")
    assert engine.scheduler.slots.num_free == 1
    assert engine.cancel("c")  # cancelling a waiting request works too
    tokens = engine.run_to_completion()
    assert len(tokens["b"]) > 0 and "a" not in tokens
    assert engine.scheduler.slots.num_free == 2
    assert not engine.cancel("zzz")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"text": ""}, "text"),
        ({"text": "   "}, "text"),
        ({"text": "hi", "voice": "nobody"}, "voice"),
        ({"text": "hi", "sampling": {"temperature": -1}}, "sampling.temperature"),
        ({"text": "hi", "sampling": {"top_p": 0}}, "sampling.top_p"),
        ({"text": "hi", "sampling": {"top_k": -3}}, "sampling.top_k"),
        ({"text": "hi", "sampling": {"bogus": 1}}, "sampling.bogus"),
        ({"text": "x" * 900}, "text"),  # longer than the 512-token context below
    ],
)
def test_bad_input_names_field_and_engine_keeps_serving(kwargs, field):
    engine = orpheus_engine(num_slots=2, max_seq_len=512)
    engine.add_request("ok", "fine text", "tara", {"temperature": 0.0, "max_tokens": 14})
    with pytest.raises(InvalidArgumentError) as err:
        engine.add_request("bad", **kwargs)
    assert err.value.field == field
    assert len(engine.run_to_completion()["ok"]) == 14


def test_orpheus_tokens_follow_frame_layout_and_stop_only_at_frame_boundary():
    engine = orpheus_engine(num_slots=4)
    for i in range(4):
        engine.add_request(f"r{i}", "frame layout", "leo", {"temperature": 1.0, "seed": i, "max_tokens": 70})
    for tokens in engine.run_to_completion().values():
        assert len(tokens) % 7 == 0
        for index, token in enumerate(tokens):
            start = AUDIO_TOKEN_BASE + (index % 7) * CODES_PER_SLOT
            assert start <= token < start + CODES_PER_SLOT and token != END_OF_SPEECH


def test_duplicate_request_id_rejected():
    engine = text_engine(tiny_text_llama())
    engine.add_prompt("x", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgumentError) as err:
        engine.add_prompt("x", [1, 2], SamplingParams(max_tokens=2))
    assert err.value.field == "request_id"

"""Voice registration requests (HTTP JSON, gRPC): every bad field is refused by name before any
encoding; a good one reaches the bank with the decoded clip."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from core.config import ModelConfig, VoicesConfig
from core.errors import InvalidArgumentError
from llm_stage.registry import check_model_config
from protos import voxray_pb2
from router.voices import VoiceRegistry, voice_request_from_json, voice_request_from_proto
from tests.detok_stage.test_voice_clip import wav_bytes


def body(**fields) -> bytes:
    return json.dumps({"audio": base64.b64encode(wav_bytes()).decode(), **fields}).encode()


class Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeBank:
    """Stands in for the VoiceBank actor's `register` and `prompt` calls (the cluster tests use the real one)."""

    def __init__(self):
        self.calls = []

        async def register(wave, rate, text):
            self.calls.append((wave, rate, text))
            from deployments.voices import Registered

            return Registered("v_" + "0" * 24, 50, wave.numel() / rate, True)

        async def prompt(voice_id):  # the Router looks a registered voice's prompt up (here: none kept)
            return None

        self.register, self.prompt = Remote(register), Remote(prompt)


def registry(model: str = "cosyvoice2-tiny") -> tuple[VoiceRegistry, FakeBank]:
    bank = FakeBank()

    async def find_bank() -> FakeBank:  # (a detok handle call in the Router)
        return bank

    return VoiceRegistry(check_model_config(ModelConfig(name=model)), VoicesConfig(), find_bank), bank


def test_a_good_registration_reaches_the_bank_with_the_decoded_clip():
    reg, bank = registry()
    fields = voice_request_from_json(body(prompt_text="  Hello   there. "))
    out = asyncio.run(reg.register(**fields))
    assert out == {"voice_id": "v_" + "0" * 24, "prompt_tokens": 50, "duration_s": 2.0, "created": True}
    ((wave, rate, text),) = bank.calls
    assert rate == 24_000 and wave.shape == (48_000,) and text == "Hello there."


@pytest.mark.parametrize(
    "raw, field",
    [
        (b"{}", "audio"),
        (json.dumps({"audio": 5}).encode(), "audio"),
        (json.dumps({"audio": "@@not base64@@"}).encode(), "audio"),
        (body(voice="x"), "voice"),
        (body(prompt_text=3), "prompt_text"),
        (b"[1, 2]", "body"),
        (b"\xff\xfe", "body"),
    ],
)
def test_bad_json_fields_are_named(raw, field):
    with pytest.raises(InvalidArgumentError) as err:
        voice_request_from_json(raw)
    assert err.value.field == field


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"model": "orpheus-tiny"}, "model"),
        ({"prompt_text": "x" * 1001}, "prompt_text"),
        ({"prompt_text": "bell\x07"}, "prompt_text"),
        ({"audio": b"not a wav"}, "audio"),
        ({"audio": wav_bytes(rate=11_025)}, "audio"),
        ({"audio": wav_bytes(seconds=0.5)}, "audio"),
        ({"audio": wav_bytes(seconds=21.0, rate=16_000)}, "audio"),
        ({"audio": b""}, "audio"),
    ],
)
def test_bad_registrations_are_refused_before_the_bank(fields, field):
    reg, bank = registry()
    request = {"audio": wav_bytes(), "prompt_text": "", "model": "", **fields}
    with pytest.raises(InvalidArgumentError) as err:
        asyncio.run(reg.register(**request))
    assert err.value.field == field and not bank.calls


def test_a_family_without_zero_shot_voices_refuses_registration():
    reg, bank = registry("orpheus-tiny")
    with pytest.raises(InvalidArgumentError) as err:
        asyncio.run(reg.register(wav_bytes(), "", ""))
    assert err.value.field == "model" and "zero-shot" in err.value.message and not bank.calls


def test_proto_requests_parse_and_garbage_is_refused():
    message = voxray_pb2.RegisterVoiceRequest(audio=b"abc", prompt_text="hi", model="m")
    assert voice_request_from_proto(message.SerializeToString()) == {"audio": b"abc", "prompt_text": "hi", "model": "m"}
    with pytest.raises(InvalidArgumentError) as err:
        voice_request_from_proto(b"\xff\xff\xff")
    assert err.value.field == "request"

"""OpenAI-style chat completions for speech in: the body maps onto a Job (a user turn of text and
input_audio, modalities text + audio) or names the field it refuses; the streamed reply is
`chat.completion.chunk` events (role, transcript deltas, audio deltas, stop, [DONE])."""

from __future__ import annotations

import asyncio
import base64
import json
from contextlib import AsyncExitStack

import numpy as np
import pytest

from core.config import AdmissionConfig
from core.errors import InvalidArgumentError
from core.messages import AudioChunk
from llm_stage.registry import get_entry
from router.chat import ChatReply, chat_request, chat_sse_body, chat_whole
from router.jobs import job_from_fields
from router.streams import SentChunk

ENTRY = get_entry("step-audio2-tiny")
PCM = (0.3 * np.sin(np.arange(16_000) / 5) * 32767).astype("<i2").tobytes()
AUDIO_PART = {"type": "input_audio", "input_audio": {"data": base64.b64encode(PCM).decode(), "format": "pcm16",
                                                      "sample_rate_hz": 16_000}}  # fmt: skip


def body(**overrides) -> bytes:
    fields = {"model": "step-audio2-tiny", "modalities": ["text", "audio"], "audio": {"format": "wav"},
              "messages": [{"role": "user", "content": [{"type": "text", "text": "Reply."}, AUDIO_PART]}]}  # fmt: skip
    return json.dumps({**fields, **overrides}).encode()


def test_a_user_turn_of_text_and_audio_becomes_a_speech_in_job() -> None:
    fields, is_streamed = chat_request(body(stream=True, max_completion_tokens=33, temperature=0.0))
    job = job_from_fields(ENTRY, AdmissionConfig(), **fields)
    assert is_streamed and job.text == "Reply." and job.audio.pcm16 == PCM and job.output_format == "wav"
    assert (job.sampling.max_tokens, job.sampling.temperature) == (33, 0.0)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"modalities": ["audio"]}, "modalities"),
        ({"modalities": ["text"]}, "audio"),  # a text-only answer has no audio settings
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "Be brief."}]}, "messages[0].role"),  # no user turn
        ({"messages": [{"role": "user", "content": [AUDIO_PART, AUDIO_PART]}]}, "messages[0].content[1]"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "%"}}]}]},
         "messages[0].content[0].input_audio.data"),
        ({"audio": {"format": "mp3"}}, "audio.format"),
        ({"tools": []}, "tools"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(overrides, field) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        job_from_fields(ENTRY, AdmissionConfig(), **chat_request(body(**overrides))[0])
    assert err.value.field == field


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


def assistant(content) -> dict:
    return {"role": "assistant", "content": content}


TEXT = {"type": "text", "text": "And now?"}


def test_a_conversation_becomes_system_history_and_the_last_turn() -> None:
    """System text, earlier user turns (text and/or a clip each) and assistant turns (their text, as a
    string or text parts) in the order given; the last user turn is the Job's own text and audio."""
    messages = [{"role": "system", "content": "Be brief."}, user({"type": "text", "text": "Hi."}, AUDIO_PART),
                assistant("Hello!"), user(AUDIO_PART), assistant([{"type": "text", "text": "Sure."}]),
                user(TEXT)]  # fmt: skip
    job = job_from_fields(ENTRY, AdmissionConfig(), **chat_request(body(messages=messages))[0])
    assert job.system == "Be brief." and job.text == "And now?" and job.audio is None
    assert [(t.role, t.text, t.audio is not None) for t in job.history] == [
        ("user", "Hi.", True), ("assistant", "Hello!", False), ("user", "", True), ("assistant", "Sure.", False)
    ]  # fmt: skip
    assert job.history[0].audio.pcm16 == PCM and job.history[2].audio.sample_rate_hz == 16_000


BAD_AUDIO = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"\0\0" * 8000).decode(),
                                                    "format": "pcm16", "sample_rate_hz": 16_000}}  # fmt: skip


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([user(TEXT), assistant("Hi.")], "messages[1].role"),  # the last message must be a user turn
        ([user(TEXT), {"role": "tool", "content": "x"}, user(TEXT)], "messages[1].role"),
        ([user(TEXT), {"role": "system", "content": "Late."}, user(TEXT)], "messages[1].role"),
        ([user(TEXT), {"role": "assistant", "content": None, "audio": {"id": "audio_1"}}, user(TEXT)],
         "messages[1].audio.id"),  # no answers are kept server-side: refused, not ignored
        ([user(TEXT), {"role": "assistant", "content": "Hi.", "name": "bot"}, user(TEXT)], "messages[1].name"),
        ([user(TEXT), assistant(None), user(TEXT)], "messages[1].content"),
        ([user(TEXT), assistant(""), user(TEXT)], "messages[1].content"),
        ([user(TEXT), assistant([AUDIO_PART]), user(TEXT)], "messages[1].content[0]"),
        ([{"role": "system", "content": [AUDIO_PART]}, user(TEXT)], "messages[0].content[0]"),
        ([{"role": "system", "content": "Be\u0007 brief."}, user(TEXT)], "messages[0].content"),
        ([user(TEXT, BAD_AUDIO), assistant("Hi."), user(TEXT)], "messages[0].content[1].input_audio.data"),
        ([user(), assistant("Hi."), user(TEXT)], "messages[0].content"),  # neither text nor audio
        ([user(TEXT), assistant("Hi."), user(TEXT, AUDIO_PART, AUDIO_PART)], "messages[2].content[2]"),
        ([user(TEXT), assistant("Hi."), "hello"], "messages[2]"),
    ],
)  # fmt: skip
def test_conversation_refusals_name_the_field(messages, field) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        job_from_fields(ENTRY, AdmissionConfig(), **chat_request(body(messages=messages))[0])
    assert err.value.field == field


def test_the_streamed_and_whole_replies() -> None:
    job = job_from_fields(ENTRY, AdmissionConfig(), **chat_request(body())[0])
    sent = [SentChunk(None, 0, None, 0.01, text="Hel"), SentChunk(None, 0, None, 0.02, text="lo"),
            SentChunk(AudioChunk(job.req_id, 0, b"\x02\x00" * 3, 24_000, True), 0, 0.1, 0.1)]  # fmt: skip

    async def chunks():
        for s in sent:
            yield s

    async def collect() -> list[bytes]:
        return [p async for p in chat_sse_body(ChatReply(job, "step-audio2-tiny"), chunks(), b"RIFF", AsyncExitStack())]

    parts = asyncio.run(collect())
    assert parts[-1] == b"data: [DONE]\n\n"
    events = [json.loads(p.decode()[len("data: ") :]) for p in parts[:-1]]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant"} and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert [d["audio"].get("transcript") for d in deltas[1:3]] == ["Hel", "lo"]
    assert base64.b64decode(deltas[3]["audio"]["data"]) == b"RIFF" + b"\x02\x00" * 3
    whole = asyncio.run(chat_whole(ChatReply(job, "step-audio2-tiny"), chunks(), 24_000))
    message = whole["choices"][0]["message"]
    assert message["audio"]["transcript"] == "Hello" and base64.b64decode(message["audio"]["data"])[:4] == b"RIFF"


def test_a_text_only_answer_streams_and_answers_as_content() -> None:
    """`modalities: ["text"]` (also OpenAI's default when left out): a text-only job, its text as
    `delta.content` pieces and `message.content`, no audio in either."""
    fields, _ = chat_request(body(modalities=["text"], audio=None))
    job = job_from_fields(ENTRY, AdmissionConfig(), **fields)
    default, _ = chat_request(json.dumps({k: v for k, v in json.loads(body(audio=None)).items()
                                          if k != "modalities"}).encode())  # fmt: skip
    assert job.text_only and job_from_fields(ENTRY, AdmissionConfig(), **default).text_only
    spoken = job_from_fields(ENTRY, AdmissionConfig(), **chat_request(body())[0])
    assert not spoken.text_only
    sent = [SentChunk(None, 0, None, 0.01, text="Hel"), SentChunk(None, 0, None, 0.02, text="lo")]

    async def chunks():
        for s in sent:
            yield s

    async def collect() -> list[bytes]:
        return [p async for p in chat_sse_body(ChatReply(job, "step-audio2-tiny"), chunks(), b"", AsyncExitStack())]

    events = [json.loads(p.decode()[len("data: ") :]) for p in asyncio.run(collect())[:-1]]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[1:3] == [{"content": "Hel"}, {"content": "lo"}] and deltas[-1] == {}
    message = asyncio.run(chat_whole(ChatReply(job, "step-audio2-tiny"), chunks(), 24_000))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hello"}


def test_a_text_only_answer_with_no_text_is_an_empty_content() -> None:
    """The model may end a text-only answer at once (`<|EOT|>` first): the stream has no chunk at all,
    and the reply is an empty `content` (the route's first read gives None, not StopAsyncIteration)."""
    from router.ingress import _chunks

    job = job_from_fields(ENTRY, AdmissionConfig(), **chat_request(body(modalities=["text"], audio=None))[0])

    async def nothing():
        return
        yield

    async def whole() -> dict:
        stream = nothing()
        first = await anext(stream, None)
        return await chat_whole(ChatReply(job, "step-audio2-tiny"), _chunks(first, stream), 24_000)

    assert asyncio.run(whole())["choices"][0]["message"] == {"role": "assistant", "content": ""}


def test_a_family_that_keeps_no_conversation_refuses_history_naming_messages() -> None:
    fields, _ = chat_request(body(model="", audio=None, modalities=["text", "audio"],
                                  messages=[user(TEXT), assistant("Hi."), user(TEXT)]))  # fmt: skip
    with pytest.raises(InvalidArgumentError) as err:
        job_from_fields(get_entry("orpheus-tiny"), AdmissionConfig(), **fields)
    assert err.value.field == "messages"
    single, _ = chat_request(body(model="", audio=None, messages=[user(TEXT)]))
    assert job_from_fields(get_entry("orpheus-tiny"), AdmissionConfig(), **single).history == ()

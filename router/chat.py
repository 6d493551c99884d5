"""OpenAI-style `POST /v1/chat/completions` for speech in: a user turn of text and `input_audio`
parts in, the answer's audio and its transcript out (`modalities: ["text", "audio"]`), whole
(JSON) or streamed as `chat.completion.chunk` SSE deltas (`delta.audio.transcript` as the text is
decoded, `delta.audio.data` per audio chunk, then `[DONE]`); with `modalities: ["text"]` (OpenAI's
default when absent) a text-only answer (`Job.text_only`: no speech, no detokenizer work), its text as
`message.content` / `delta.content`.

`chat_request` maps the body onto `job_from_fields` keyword arguments (checked as every request
is; errors name the field as the client spelled it, e.g. `messages[2].content[1].input_audio.data`).
Multi-turn: a system message, earlier user turns (text, clips) and assistant turns (their text; an
assistant's `audio.id` is refused: no answers are kept server-side) become `Job.system` and
`Job.history` (`router.chat_turns`); the conversation must fit the LM's cache, else the LLM replica
refuses it naming `messages`. The Router's `/v1/chat/completions` route uses it.
"""

from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

from core.errors import InvalidArgumentError
from core.messages import Job
from llm_stage.jobs import printable_name
from router.audio_format import wav_bytes
from router.chat_turns import conversation
from router.jobs import MAX_AUDIO_JSON_BYTES, MAX_BODY_BYTES, http_request_id, parse_json_object
from router.sse import event
from router.streams import SentChunk

CHAT_FIELDS = frozenset(
    {"model", "messages", "modalities", "audio", "stream", "max_tokens", "max_completion_tokens", "temperature",
     "top_p", "seed", "request_id"}
)  # fmt: skip
SAMPLING_FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
                   "top_p": "top_p", "seed": "seed"}  # fmt: skip
CHAT_AUDIO_FORMATS = {"pcm16": "pcm16", "wav": "wav"}
MODALITIES = (["text", "audio"], ["text"])


def chat_request(body: bytes, header_req_ids: list[str] = ()) -> tuple[dict, bool]:
    """(`job_from_fields` keyword arguments, whether to stream) from a chat-completions body."""
    obj = parse_json_object(body, MAX_BODY_BYTES + MAX_AUDIO_JSON_BYTES)
    unknown = set(obj) - CHAT_FIELDS
    if unknown:
        raise InvalidArgumentError(printable_name(sorted(unknown)[0]), "unknown field")
    modalities = obj.get("modalities", ["text"])
    if modalities not in MODALITIES:
        raise InvalidArgumentError("modalities", 'must be ["text", "audio"] (a spoken answer) or ["text"]')
    text_only = modalities == ["text"]
    if text_only and obj.get("audio") is not None:
        raise InvalidArgumentError("audio", 'is for spoken answers: modalities ["text", "audio"]')
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidArgumentError("stream", "must be true or false")
    chat = conversation(obj.get("messages"))
    voice, output_format = answer_audio(obj.get("audio"))
    fields = {
        "text": chat.text, "model": _str(obj, "model"), "voice": voice, "sampling": chat_sampling(obj),
        "output_format": output_format, "sample_rate_hz": 0, "ttfa_deadline_s": 0.0,
        "req_id": http_request_id(obj.get("request_id"), header_req_ids), "text_field": "messages",
        "input_audio": chat.audio, "text_only": text_only, "system": chat.system,
        "system_field": "messages[0].content", "history": chat.history,
    }  # fmt: skip
    return fields, stream


def answer_audio(value: object) -> tuple[str, str]:
    """(voice, output format) of `audio: {voice, format}` (pcm16 or wav)."""
    if value is None:
        return "", "pcm16"
    if not isinstance(value, dict) or set(value) - {"voice", "format"}:
        raise InvalidArgumentError("audio", "must be {voice, format}")
    fmt = value.get("format", "pcm16")
    if fmt not in CHAT_AUDIO_FORMATS:
        raise InvalidArgumentError("audio.format", "must be one of: pcm16, wav")
    voice = value.get("voice", "")
    if not isinstance(voice, str):
        raise InvalidArgumentError("audio.voice", "must be a string")
    return voice, CHAT_AUDIO_FORMATS[fmt]


def chat_sampling(obj: dict) -> dict:
    return {ours: obj[theirs] for theirs, ours in SAMPLING_FIELDS.items() if obj.get(theirs) is not None}


def _str(obj: dict, name: str) -> str:
    value = obj.get(name, "")
    if not isinstance(value, str):
        raise InvalidArgumentError(name, "must be a string")
    return value


class ChatReply:
    """One answer's OpenAI envelope: ids, model, creation time; chunks and the whole reply."""

    def __init__(self, job: Job, model: str) -> None:
        self.job, self.model = job, model
        self.id, self.audio_id = f"chatcmpl-{job.req_id}", f"audio_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def chunk(self, delta: dict, finish_reason: str | None = None) -> bytes:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}  # fmt: skip
        return event(body)

    def delta(self, sent: SentChunk) -> dict:
        if self.job.text_only:
            return {"content": sent.text}
        if sent.audio is None:
            return {"audio": {"id": self.audio_id, "transcript": sent.text}}
        return {"audio": {"id": self.audio_id, "data": base64.b64encode(sent.audio.pcm16).decode("ascii")}}

    def whole(self, audio: bytes, transcript: str) -> dict:
        """The whole answer: its text as `content` (text only), else its audio and transcript."""
        message: dict = {"role": "assistant", "content": transcript}
        if not self.job.text_only:
            message = {"role": "assistant", "content": None,
                       "audio": {"id": self.audio_id, "data": base64.b64encode(audio).decode("ascii"),
                                 "transcript": transcript, "expires_at": self.created + 3600}}  # fmt: skip
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip


async def chat_sse_body(
    reply: ChatReply, chunks: AsyncIterator[SentChunk], header: bytes, lease: AsyncExitStack
) -> AsyncIterator[bytes]:
    """The streamed answer: the role, then a delta per text piece and per audio chunk (the first
    audio carries the WAV header when `audio.format` is wav), a stop chunk and `[DONE]`."""
    try:
        yield reply.chunk({"role": "assistant"})
        async for sent in chunks:
            if sent.audio is not None and header:
                sent, header = _with_header(sent, header), b""
            yield reply.chunk(reply.delta(sent))
        yield reply.chunk({}, "stop")
        yield b"data: [DONE]\n\n"
    finally:
        await lease.aclose()


async def chat_whole(reply: ChatReply, chunks: AsyncIterator[SentChunk], sample_rate_hz: int) -> dict:
    """The answer whole: its audio (a WAV file when `audio.format` is wav) and its transcript."""
    audio, text = [], []
    async for sent in chunks:
        if sent.audio is None:
            text.append(sent.text)
        else:
            audio.append(sent.audio.pcm16)
    pcm16 = b"".join(audio)
    data = wav_bytes(pcm16, sample_rate_hz) if reply.job.output_format == "wav" else pcm16
    return reply.whole(data, "".join(text))


def _with_header(sent: SentChunk, header: bytes) -> SentChunk:
    return dataclasses.replace(sent, audio=dataclasses.replace(sent.audio, pcm16=header + sent.audio.pcm16))

"""OpenAI's `stream_format: "sse"` for `POST /v1/audio/speech`: server-sent events.

Each audio chunk becomes one `speech.audio.delta` event (base64 audio bytes, the first one with
the WAV header when `response_format` is wav), and the stream ends with one `speech.audio.done`
event, as OpenAI documents. A failure after the response started (its status is already 200)
ends the stream with an `error` event carrying the short message, never internals.
"""

from __future__ import annotations

import base64
import json
from typing import Literal

StreamFormat = Literal["audio", "sse"]
STREAM_FORMATS: tuple[StreamFormat, ...] = ("audio", "sse")
MEDIA_TYPE = "text/event-stream"


def event(payload: dict) -> bytes:
    """One SSE event carrying `payload` as its JSON data."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def audio_delta(audio: bytes) -> bytes:
    return event({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode("ascii")})


def text_delta(text: str) -> bytes:
    """Speech in: a piece of the answer's text, sent as it is decoded (ahead of its audio)."""
    return event({"type": "speech.text.delta", "text": text})


def audio_done(num_input_chars: int, num_audio_frames: int) -> bytes:
    """The closing event; `usage` counts the input characters and the audio frames generated."""
    usage = {"input_tokens": num_input_chars, "output_tokens": num_audio_frames}
    return event({"type": "speech.audio.done", "usage": {**usage, "total_tokens": sum(usage.values())}})


def error_event(message: str, code: str) -> bytes:
    return event({"type": "error", "error": {"message": message, "code": code}})

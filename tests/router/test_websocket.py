"""The incremental-text WebSocket protocol (`router.websocket`) on a Starlette test server, with
sessions on a real in-process orpheus-tiny engine: framing, config, and bad messages answered by
an error naming the field, then a close with the documented code."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager, nullcontext

import pytest
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from core.config import AdmissionConfig, IncrementalConfig
from llm_stage.registry import get_entry
from router.audio_format import streaming_wav_header
from router.incremental import IncrementalSession
from router.ingress import _failure
from router.jobs import job_from_fields
from router.websocket import CLOSE_BAD_MESSAGE, CLOSE_IDLE, CLOSE_UNSUPPORTED, StreamEndpoint
from tests.router.test_incremental import LocalRunner

ENTRY = get_entry("orpheus-tiny")


@pytest.fixture(scope="module")
def client():
    runner = LocalRunner("orpheus-tiny")

    @asynccontextmanager
    async def open_session(job):
        config = IncrementalConfig(idle_timeout_s=1.0, max_piece_chars=200)
        yield IncrementalSession(job, ENTRY.family.lm, config, runner, ENTRY.sample_rate_hz)

    def template(fields):
        return job_from_fields(ENTRY, AdmissionConfig(), **{**fields, "req_id": fields["req_id"] or "ws-1"})

    endpoint = StreamEndpoint(
        authorize=lambda websocket: nullcontext_async(),
        template=template,
        open_session=open_session,
        wav_header=streaming_wav_header(ENTRY.sample_rate_hz),
        failure_of=_failure,
    )  # fmt: skip
    app = FastAPI()

    @app.websocket("/stream")
    async def stream(websocket: WebSocket) -> None:
        await endpoint.serve(websocket, "fallback-id")

    with TestClient(app) as test_client:
        yield test_client


@asynccontextmanager
async def nullcontext_async():
    with nullcontext():
        yield


def read_until_close(ws) -> tuple[list, int]:
    """Every message until the server closes: JSON objects and byte strings, and the close code."""
    got = []
    while True:
        try:
            message = ws.receive()
        except WebSocketDisconnect as gone:
            return got, gone.code
        if message["type"] == "websocket.close":
            return got, message["code"]
        got.append(json.loads(message["text"]) if message.get("text") is not None else message["bytes"])


def test_text_pieces_flush_and_end_stream_audio_frames_then_done(client):
    with client.websocket_connect("/stream") as ws:
        ws.send_json({"voice": "leah", "response_format": "wav", "sampling": {"seed": 3, "max_tokens": 14}})
        for piece in ["Hello ", "there, ", "my friend"]:
            ws.send_json({"text": piece})
        ws.send_json({"flush": True})
        ws.send_json({"text": "Bye.", "end": True})
        got, code = read_until_close(ws)
    assert code == 1000 and got[-1]["type"] == "done"
    assert got[0] == {"type": "ready", "request_id": "ws-1", "sample_rate_hz": 24000}
    metas, blobs = got[1:-1:2], got[2:-1:2]
    assert all(m["type"] == "audio" for m in metas) and all(isinstance(b, bytes) for b in blobs)
    assert [m["seq"] for m in metas] == list(range(len(metas))) and {m["segment"] for m in metas} == {0, 1}
    assert [m["num_bytes"] for m in metas] == [len(b) for b in blobs]
    assert blobs[0][:4] == b"RIFF" and sum(m["segment_end"] for m in metas) == 2
    assert got[-1]["audio_s"] == pytest.approx(sum(m["duration_s"] for m in metas), abs=1e-5)


BAD = [
    ([{"text": "hi"}], "text", "config message first", CLOSE_BAD_MESSAGE),
    ([{}, {"voice": "leah"}], "voice", "already configured", CLOSE_BAD_MESSAGE),
    ([{}, {"text": "x" * 201}], "text", "limit is 200", CLOSE_BAD_MESSAGE),
    ([{"colour": "red"}], "colour", "unknown field", CLOSE_BAD_MESSAGE),
    ([{}, {"text": "hi", "pitch": 2}], "pitch", "unknown field", CLOSE_BAD_MESSAGE),
    ([{"voice": "nobody"}], "voice", "unknown voice", CLOSE_BAD_MESSAGE),
    ([{"sampling": {"temperature": "hot"}}], "sampling.temperature", "", CLOSE_BAD_MESSAGE),
    ([{}, {"flush": False}], "flush", "must be true", CLOSE_BAD_MESSAGE),
    ([{}, {"text": 3}], "text", "must be a string", CLOSE_BAD_MESSAGE),
    ([{}, "[1, 2]"], "body", "JSON object", CLOSE_BAD_MESSAGE),
    ([{}, "{not json"], "body", "not valid JSON", CLOSE_BAD_MESSAGE),
    ([{}, b"\x00\x01"], None, "binary messages", CLOSE_UNSUPPORTED),
    ([{}, {"text": "Words to speak. ", "end": True}, {"text": "late"}], "text", "already ended", CLOSE_BAD_MESSAGE),
]


@pytest.mark.parametrize(("messages", "param", "message", "close_code"), BAD)
def test_bad_messages_get_an_error_naming_the_field_then_close(client, messages, param, message, close_code):
    with client.websocket_connect("/stream") as ws:
        for item in messages:
            if isinstance(item, bytes):
                ws.send_bytes(item)
            elif isinstance(item, str):
                ws.send_text(item)
            else:
                ws.send_json(item)
        got, code = read_until_close(ws)
    error = got[-1]
    assert code == close_code and error["type"] == "error" and error["param"] == param
    assert message in error["message"] and "Traceback" not in error["message"]


def test_a_stream_without_text_is_closed_after_the_idle_timeout(client):
    with client.websocket_connect("/stream") as ws:
        ws.send_json({"sampling": {"max_tokens": 7}})
        got, code = read_until_close(ws)
    assert code == CLOSE_IDLE and got[-1]["code"] == "DEADLINE_EXCEEDED"
    assert "incremental.idle_timeout_s" in got[-1]["message"]

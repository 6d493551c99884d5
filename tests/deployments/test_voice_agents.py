"""Issue 27 (HTTP side) under a real local Ray + Serve: OpenAI `stream_format: "sse"` through the
`openai` SDK, and the incremental-text WebSocket on the HTTP port."""

from __future__ import annotations

import base64
import json
import time

import grpc
import numpy as np
import pytest
import requests
from openai import OpenAI

from tests.deployments.conftest import TIGHT

pytestmark = pytest.mark.slow
SEEDED = {"seed": 7, "max_tokens": 70}


def sse_events(ep, **body) -> list[dict]:
    """The events of one `stream_format: "sse"` request, read with the openai SDK."""
    client = OpenAI(base_url=ep.http_url + "/v1", api_key="unused", max_retries=0)
    with client.audio.speech.with_streaming_response.create(
        model="orpheus-tiny", voice="tara", response_format="pcm", stream_format="sse", **body
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.int32)


def test_openai_sdk_sse_streams_deltas_then_done_with_the_raw_streams_audio(cluster):
    ep = cluster["tight"]
    events = sse_events(ep, input="Hello from the SDK.", extra_body={"sampling": SEEDED})
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) > 2
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] == 10
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    raw = requests.post(
        ep.http_url + "/v1/audio/speech", timeout=60,
        json={"input": "Hello from the SDK.", "voice": "tara", "response_format": "pcm", "stream_format": "audio",
              "sampling": SEEDED},
    )  # fmt: skip
    assert raw.status_code == 200 and len(raw.content) == len(audio) == 10 * 2048 * 2
    assert np.abs(pcm(audio) - pcm(raw.content)).max() <= 2  # same tokens; float noise of batched decoding only


def test_sse_bad_stream_format_is_400_naming_it(cluster):
    resp = requests.post(
        cluster["tight"].http_url + "/v1/audio/speech", timeout=30,
        json={"input": "hi", "stream_format": "events"},
    )  # fmt: skip
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_format"


def ws_url(ep) -> str:
    return ep.http_url.replace("http://", "ws://", 1) + "/v1/audio/speech/stream"


def ws_messages(ws) -> tuple[list, int]:
    """Every message until the server closes the socket, and its close code."""
    from websockets.exceptions import ConnectionClosed

    got = []
    try:
        while True:
            message = ws.recv(timeout=120)
            got.append(json.loads(message) if isinstance(message, str) else message)
    except ConnectionClosed as closed:
        return got, closed.rcvd.code if closed.rcvd else -1


def test_websocket_through_serves_http_proxy_streams_each_segment_as_its_text_arrives(cluster):
    from websockets.sync.client import connect

    ep = cluster["tight"]
    with connect(ws_url(ep), open_timeout=60) as ws:
        ws.send(json.dumps({"voice": "tara", "sampling": {"seed": 4, "max_tokens": 14}, "request_id": "ws-cluster"}))
        assert json.loads(ws.recv(timeout=60)) == {"type": "ready", "request_id": "ws-cluster", "sample_rate_hz": 24000}
        ws.send(json.dumps({"text": "First sentence here. "}))
        meta = json.loads(ws.recv(timeout=120))  # the first segment speaks before the rest of the text exists
        assert meta["type"] == "audio" and meta["segment"] == 0 and len(ws.recv(timeout=60)) == meta["num_bytes"]
        ws.send(json.dumps({"text": "And a second one", "end": True}))
        got, code = ws_messages(ws)
    assert code == 1000 and got[-1]["type"] == "done"
    metas, blobs = [meta] + got[0:-1:2], got[1:-1:2]
    assert {m["segment"] for m in metas} == {0, 1} and [m["seq"] for m in metas] == list(range(len(metas)))
    assert meta["num_bytes"] + sum(len(b) for b in blobs) == 2 * 2 * 2048 * 2  # 2 frames a segment


def test_websocket_bad_config_through_the_cluster_names_the_field_and_closes_1008(cluster):
    from websockets.sync.client import connect

    with connect(ws_url(cluster["tight"]), open_timeout=60) as ws:
        ws.send(json.dumps({"text": "no config yet"}))
        got, code = ws_messages(ws)
    assert code == 1008 and got[-1]["type"] == "error" and got[-1]["param"] == "text"


def test_say_incremental_types_words_at_a_pace_and_prints_each_pieces_time_to_audio(cluster, tmp_path, capsys):
    from cluster.cli import main

    out = tmp_path / "inc.wav"
    text = "One short sentence. Then another one follows"
    argv = ["say", text, "--incremental", "--pace", "30", "--max-tokens", "14", "-o", str(out)]
    assert main([*argv, "--url", ws_url(cluster["tight"])]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(text.split()) + 1 and all("first audio +" in line for line in lines[:-1])
    assert "first piece -> first audio" in lines[-1] and out.read_bytes()[:4] == b"RIFF"
    assert len(out.read_bytes()) == 44 + 2 * 2 * 2048 * 2  # two segments of two frames


def open_stream(ep, sampling: dict, admit_within_s: float = 45.0):
    """An admitted incremental stream. A refusal for load is retried: the Router's load board can
    still hold an earlier test's streams for a stats period or two after they ended (longer on a
    loaded machine: 15 s ran out once with a load average of 16 on 2 cores)."""
    from websockets.sync.client import connect

    give_up_s = time.monotonic() + admit_within_s
    while True:
        ws = connect(ws_url(ep), open_timeout=60)
        ws.send(json.dumps({"sampling": sampling}))
        reply = json.loads(ws.recv(timeout=60))
        if reply["type"] == "ready":  # sent once the router admitted the stream
            return ws
        ws.close()
        assert reply.get("code") == "RESOURCE_EXHAUSTED" and time.monotonic() < give_up_s, reply
        time.sleep(0.2)


def test_streams_waiting_for_text_hold_no_engine_row_yet_count_for_admission(cluster):
    from ray import serve

    from tests.deployments.grpc_helpers import run_stream

    ep = cluster["tight"]
    limit = TIGHT.admission.max_streams_per_replica + TIGHT.admission.max_queued_per_replica
    sockets = [open_stream(ep, {"seed": i, "max_tokens": 7}) for i in range(limit)]
    try:
        sockets[0].send(json.dumps({"text": "Spoken, then waiting. "}))
        while not json.loads(meta := sockets[0].recv(timeout=120)).get("segment_end"):
            sockets[0].recv(timeout=60)  # the chunk's bytes
        assert json.loads(meta)["segment"] == 0
        llm = serve.get_deployment_handle("LLMStage", ep.app_name)
        deadline_s = time.monotonic() + 10
        while (stats := llm.stats.remote().result())["engine_requests"] and time.monotonic() < deadline_s:
            time.sleep(0.1)
        assert stats["engine_requests"] == 0 and stats["kv_slots_used"] == 0  # waiting for text holds nothing
        refused = run_stream(ep.grpc_target, ep.app_name, "one too many", sampling={"max_tokens": 7})
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED  # yet each open stream counts as one
    finally:
        for ws in sockets:
            ws.close()
    for _ in range(50):  # the router sees the closes within moments; then there is room again
        outcome = run_stream(ep.grpc_target, ep.app_name, "room again", sampling={"max_tokens": 7})
        if outcome.code == grpc.StatusCode.OK:
            break
        time.sleep(0.2)
    assert outcome.code == grpc.StatusCode.OK

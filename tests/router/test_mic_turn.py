"""Streamed microphone input's protocol (`router.mic_turn`, `router.grpc_converse`,
`router.mic_websocket`): the stated encoding and rate, each piece and the turn as a whole are
checked, every refusal naming the client's field; the turn's Job carries the whole clip and the
features computed as it came; a client that leaves mid-turn leaves nothing behind."""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from contextlib import asynccontextmanager
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient

from core.config import AdmissionConfig, IncrementalConfig, ServeConfig, SpeechInConfig
from core.errors import InvalidArgumentError
from llm_stage.registry import get_entry
from protos import voxray_pb2
from router.grpc_converse import open_turn, read_config, read_turn
from router.incremental import IdleTimeout
from router.ingress import _failure
from router.jobs import job_from_fields
from router.mic_turn import MicFields, MicTurn, turn_job
from router.mic_websocket import MicEndpoint, end_of_turn, mic_config
from router.websocket import CLOSE_BAD_MESSAGE, CLOSE_IDLE
from tests.router.test_websocket import read_until_close

STEP_AUDIO = get_entry("step-audio2-tiny")
SPEECH_IN = SpeechInConfig(min_audio_s=0.1, max_audio_s=2.0)


def tone(seconds: float, rate: int) -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()


async def read_nothing() -> None:
    """An endpoint's reading loop that has already fed the turn."""


def new_turn(rate: int = 24_000) -> MicTurn:
    return MicTurn(STEP_AUDIO, SPEECH_IN, rate, MicFields())


def refused(call, *args) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as caught:
        call(*args)
    return caught.value


# ---- the turn -------------------------------------------------------------------------------


def test_a_turn_pushed_in_pieces_makes_a_job_with_the_clip_and_its_features():
    pcm, turn = tone(0.5, 24_000), new_turn()
    for start in range(0, len(pcm), 960):  # 20 ms pieces
        turn.push(pcm[start : start + 960])

    def make_job(**fields):
        return job_from_fields(STEP_AUDIO, AdmissionConfig(), speech_in=SPEECH_IN, **fields)

    fields = {"text": "", "model": "", "voice": "", "sampling": {"temperature": 0.0}, "output_format": "pcm16",
              "sample_rate_hz": 0, "ttfa_deadline_s": 0.0, "req_id": "mic-1"}  # fmt: skip
    job = asyncio.run(turn_job(make_job, fields, turn, read_nothing()))
    assert job.audio.pcm16 == pcm and job.audio.sample_rate_hz == 24_000
    assert job.audio_features.front_end == "step-audio2/log-mel-128/v1"
    assert [m.shape for m in job.audio_features.mels] == [(128, 52)]  # 0.5 s at 16 kHz + 479 zeros, hop 160


@pytest.mark.parametrize(
    ("piece", "says"),
    [(b"", "is empty"), (b"\x01\x02\x03", "has 3 bytes"), (b"RIFF\x24\x00\x00\x00WAVEfmt ", "is a WAV file")],
)
def test_a_bad_piece_is_refused_naming_audio(piece: bytes, says: str):
    err = refused(new_turn().push, piece)
    assert err.field == "audio" and says in str(err)


def test_a_turn_longer_than_the_family_max_is_refused_as_it_passes_the_limit():
    turn = new_turn()
    turn.push(tone(1.9, 24_000))
    err = refused(turn.push, tone(0.2, 24_000))
    assert err.field == "audio" and "at most 2 s" in str(err)


@pytest.mark.parametrize(
    ("pcm", "says"), [(b"", "before any audio"), (tone(0.05, 24_000), "at least 0.1 s"), (bytes(4800), "silent")]
)
def test_a_turn_too_short_silent_or_empty_is_refused_at_its_end(pcm: bytes, says: str):
    turn = new_turn()
    if pcm:
        turn.push(pcm)
    err = refused(turn.finish)
    assert err.field == "audio" and says in str(err)


def test_a_model_that_takes_no_audio_is_refused_naming_model():
    err = refused(MicTurn, get_entry("orpheus-tiny"), SPEECH_IN, 24_000, MicFields(model="config.model"))
    assert err.field == "config.model" and "takes no audio" in str(err)


# ---- gRPC Converse ----------------------------------------------------------------------------


def messages(*items: voxray_pb2.ConverseRequest | bytes):
    async def gen():
        for item in items:
            yield item if isinstance(item, bytes) else item.SerializeToString()

    return gen()


def config(fmt=voxray_pb2.INPUT_AUDIO_PCM16, rate=24_000, data=b"", **kwargs) -> voxray_pb2.ConverseRequest:
    audio = voxray_pb2.InputAudio(format=fmt, sample_rate_hz=rate, data=data)
    return voxray_pb2.ConverseRequest(config=voxray_pb2.SynthesizeRequest(input_audio=audio, **kwargs))


def grpc_refusal(*items) -> InvalidArgumentError:
    async def run():
        requests = messages(*items)
        fields, rate, first = await read_config(requests)
        await read_turn(requests, open_turn(STEP_AUDIO, SPEECH_IN, rate, first), 5.0)

    with pytest.raises(InvalidArgumentError) as caught:
        asyncio.run(run())
    return caught.value


def test_grpc_config_then_pieces_then_end_of_turn():
    pcm = tone(0.3, 16_000)

    async def run():
        requests = messages(config(rate=16_000, data=pcm[:3200], text="Answer.", request_id="turn-1"),
                            voxray_pb2.ConverseRequest(audio=pcm[3200:]),
                            voxray_pb2.ConverseRequest(end_of_turn=True))  # fmt: skip
        fields, rate, first = await read_config(requests)
        turn = open_turn(STEP_AUDIO, SPEECH_IN, rate, first)
        await read_turn(requests, turn, 5.0)
        return fields, turn

    fields, turn = asyncio.run(run())
    assert fields["text"] == "Answer." and fields["input_audio"] is None and fields["req_id"] == "turn-1"
    assert bytes(turn.pcm16) == pcm and turn.sample_rate_hz == 16_000


@pytest.mark.parametrize(
    ("items", "field"),
    [
        ((voxray_pb2.ConverseRequest(audio=b"\x00\x01"),), "config"),
        ((voxray_pb2.ConverseRequest(config=voxray_pb2.SynthesizeRequest(text="hi")),), "config.input_audio"),
        ((config(fmt=voxray_pb2.INPUT_AUDIO_WAV),), "config.input_audio.format"),
        ((config(rate=8_000),), "config.input_audio.sample_rate_hz"),
        ((config(rate=0),), "config.input_audio.sample_rate_hz"),
        ((config(request_id="has space"),), "config.request_id"),  # at the config, not after the turn
        ((config(request_id="x" * 129),), "config.request_id"),
        ((config(), voxray_pb2.ConverseRequest(audio=b"\x00\x01\x02")), "audio"),
        ((config(), config()), "config"),
        ((config(), voxray_pb2.ConverseRequest()), "input"),
        ((config(), b"\xff\xfe garbage"), "request"),
        ((), "config"),
    ],
)
def test_grpc_refusals_name_the_field(items, field: str):
    assert grpc_refusal(*items).field == field


def test_grpc_a_turn_that_stalls_ends_idle():
    async def run():
        async def stalled():
            yield config().SerializeToString()
            await asyncio.sleep(10)

        requests = stalled()
        _, rate, first = await read_config(requests)
        await read_turn(requests, open_turn(STEP_AUDIO, SPEECH_IN, rate, first), 0.05)

    with pytest.raises(IdleTimeout):
        asyncio.run(run())


def test_grpc_a_client_leaving_mid_turn_leaves_nothing_behind():
    """The turn (its audio and front end) lives only in the call's reader: cancelled, it is freed."""
    refs: list[weakref.ref] = []

    async def run():
        arrived = asyncio.Event()

        async def pieces():
            yield config().SerializeToString()
            yield voxray_pb2.ConverseRequest(audio=tone(0.5, 24_000)).SerializeToString()
            arrived.set()
            await asyncio.Event().wait()  # the client goes quiet, then its call is cancelled

        async def call():
            requests = pieces()
            _, rate, first = await read_config(requests)
            turn = open_turn(STEP_AUDIO, SPEECH_IN, rate, first)
            refs.extend([weakref.ref(turn), weakref.ref(turn.front_end)])
            await read_turn(requests, turn, 30.0)

        task = asyncio.ensure_future(call())
        await arrived.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    gc.collect()
    assert refs and all(ref() is None for ref in refs)


# ---- the WebSocket ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ({}, "input_audio"),
        ({"input_audio": {"format": "wav", "sample_rate_hz": 24_000}}, "input_audio.format"),
        ({"input_audio": {"sample_rate_hz": 11_025}}, "input_audio.sample_rate_hz"),
        ({"input_audio": {"sample_rate_hz": "24000"}}, "input_audio.sample_rate_hz"),
        ({"input_audio": {"sample_rate_hz": 24_000, "channels": 2}}, "input_audio.channels"),
        ({"input_audio": {"sample_rate_hz": 24_000}, "stream": True}, "stream"),
        ({"end_of_turn": True}, "end_of_turn"),
        ({"input_audio": {"sample_rate_hz": 24_000}, "response_format": "mp3"}, "response_format"),
    ],
)
def test_websocket_config_refusals_name_the_field(obj: dict, field: str):
    assert refused(mic_config, obj).field == field


def test_websocket_end_of_turn_message():
    end_of_turn({"end_of_turn": True})
    assert refused(end_of_turn, {"end_of_turn": False}).field == "end_of_turn"
    assert refused(end_of_turn, {"model": "x"}).field == "model"
    assert refused(end_of_turn, {"text": "more"}).field == "text"


class Holds:
    """What the endpoint's `authorize` holds (the key's stream slot in the Router): taken and given back."""

    def __init__(self) -> None:
        self.held = 0

    @asynccontextmanager
    async def authorize(self, websocket):
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1


@pytest.fixture
def ws_client():
    """The endpoint with the real step-audio2-tiny entry, a ServeConfig and RouterCore's own job validation:
    nothing else is reached before a turn's Job is admitted (its run is the cluster's, with a turn answered
    end to end: tests/deployments/test_zz_speech_in.py)."""
    serve_config = ServeConfig(speech_in=SPEECH_IN, incremental=IncrementalConfig(idle_timeout_s=0.5))

    def job(**fields):
        return job_from_fields(STEP_AUDIO, serve_config.admission, speech_in=SPEECH_IN, **fields)

    core = SimpleNamespace(entry=STEP_AUDIO, config=serve_config, job=job, mic_forward=lambda rate: None)
    holds = Holds()
    endpoint = MicEndpoint(holds.authorize, lambda model: core, _failure)
    app = FastAPI()

    @app.websocket("/converse")
    async def converse(websocket: WebSocket) -> None:
        await endpoint.serve(websocket, "fallback-id")

    with TestClient(app) as client:
        yield client, holds


READY = {"type": "ready", "request_id": "fallback-id", "sample_rate_hz": 24_000}
CONFIG = {"input_audio": {"format": "pcm16", "sample_rate_hz": 24_000}}


@pytest.mark.parametrize(
    ("sends", "field"),
    [
        ([b"\x00\x01"], "config"),
        ([CONFIG, b"\x00\x01\x02"], "audio"),
        ([CONFIG, tone(1.5, 24_000), tone(0.6, 24_000)], "audio"),
        ([CONFIG, CONFIG], "input_audio"),
        ([CONFIG, {"end_of_turn": True}], "audio"),
        ([CONFIG, bytes(9600), {"end_of_turn": True}], "audio"),
    ],
)
def test_websocket_refusals_close_1008_naming_the_field(ws_client, sends: list, field: str):
    client, holds = ws_client
    with client.websocket_connect("/converse") as ws:
        for item in sends:
            ws.send_bytes(item) if isinstance(item, bytes) else ws.send_text(json.dumps(item))
        got, code = read_until_close(ws)
    assert code == CLOSE_BAD_MESSAGE and got[-1]["type"] == "error" and got[-1]["param"] == field
    assert got[-1]["code"] == "INVALID_ARGUMENT" and holds.held == 0


def test_websocket_a_stalled_turn_closes_idle(ws_client):
    client, holds = ws_client
    with client.websocket_connect("/converse") as ws:
        ws.send_text(json.dumps(CONFIG))
        ws.send_bytes(tone(0.2, 24_000))
        got, code = read_until_close(ws)
    assert got[0] == READY and code == CLOSE_IDLE and got[-1]["code"] == "DEADLINE_EXCEEDED" and holds.held == 0


def test_websocket_a_client_leaving_mid_turn_gives_back_its_slot(ws_client):
    client, holds = ws_client
    with client.websocket_connect("/converse") as ws:
        ws.send_text(json.dumps(CONFIG))
        assert ws.receive_json() == READY
        ws.send_bytes(tone(0.2, 24_000))
        assert holds.held == 1
    for _ in range(100):  # the server side notices the close on its own loop
        if holds.held == 0:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert holds.held == 0

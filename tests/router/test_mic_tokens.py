"""A streamed microphone turn of GLM-4-Voice (whose speech tokenizer needs the model's weights) is
tokenized on an LLM replica as its pieces come (`router.mic_tokens` -> `llm_stage.mic_turns`, the
real tiny-preset adapter behind a sender standing in for Serve's handle): the turn's Job carries the
tokens the whole clip gives, and the prompt is the one the whole clip makes; a lost replica, or one
that does not hold the turn, leaves the Job the whole clip; an abandoned turn is dropped there."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from ray.exceptions import ActorUnavailableError

from core.config import AdmissionConfig, ModelConfig, SpeechInConfig
from core.errors import InvalidArgumentError
from core.messages import AudioClip, MicPiece, MicTokens
from llm_stage.mic_turns import MicTurns
from llm_stage.models.glm4_voice import Glm4VoiceAdapter
from llm_stage.registry import get_entry
from router.incremental import IdleTimeout
from router.jobs import job_from_fields
from router.mic_tokens import ReplicaMicTokens
from router.mic_turn import MicFields, MicTurn, turn_job

GLM = get_entry("glm4-voice-tiny")
SPEECH_IN = SpeechInConfig(min_audio_s=0.1, max_audio_s=10.0)
TAG = "LLMStage#r1"
FIELDS = {"text": "", "model": "", "voice": "", "sampling": {"temperature": 0.0}, "output_format": "pcm16",
          "sample_rate_hz": 0, "ttfa_deadline_s": 0.0, "req_id": "mic-glm"}  # fmt: skip


@pytest.fixture(scope="module")
def adapter() -> Glm4VoiceAdapter:
    return Glm4VoiceAdapter.build(ModelConfig(name="glm4-voice-tiny", seed=0))


def speech(seconds: float, rate: int) -> bytes:
    """A voiced-like signal (two tones under a slow envelope): tokens that vary along the clip."""
    t = np.arange(round(seconds * rate)) / rate
    wave = (0.2 * np.sin(2 * np.pi * 180 * t) + 0.1 * np.sin(2 * np.pi * 730 * t)) * (0.6 + 0.4 * np.sin(3 * t))
    return (wave * 32767).astype("<i2").tobytes()


class Replica:
    """The LLM replica's side of `LLMStage.mic_piece` (its MicTurns on the real adapter), behind a sender
    that counts calls, runs each off the loop as Serve's replica does, and can be lost."""

    def __init__(self, adapter: Glm4VoiceAdapter, max_turns: int = 4, lost_after: int | None = None) -> None:
        self.turns = MicTurns(adapter, max_turns=max_turns, idle_s=60.0)
        self.pieces: list[MicPiece] = []
        self.lost_after = lost_after

    async def send(self, piece: MicPiece) -> MicTokens:
        self.pieces.append(piece)
        if self.lost_after is not None and len(self.pieces) > self.lost_after:
            raise ActorUnavailableError("the replica is gone")
        if piece.llm_replica and piece.llm_replica != TAG:
            return MicTokens("")
        return await asyncio.to_thread(self.turns.take, piece, TAG)


def make_job(**fields):
    return job_from_fields(GLM, AdmissionConfig(), speech_in=SPEECH_IN, **fields)


async def stream_turn(replica: Replica, pcm: bytes, rate: int, piece_bytes: int):
    """Push the turn in pieces as an endpoint does (yielding between them, as awaiting the socket does)."""
    turn = MicTurn(GLM, SPEECH_IN, rate, MicFields(), ReplicaMicTokens(replica.send, "turn-1", rate))

    async def reading() -> None:
        for start in range(0, len(pcm), piece_bytes):
            turn.push(pcm[start : start + piece_bytes])
            await asyncio.sleep(0.005)

    return await turn_job(make_job, FIELDS, turn, reading())


@pytest.mark.parametrize("rate", [16_000, 24_000])
def test_the_turns_job_carries_the_tokens_and_prompt_of_the_whole_clip(adapter, rate: int):
    pcm, replica = speech(5.0, rate), Replica(adapter)
    job = asyncio.run(stream_turn(replica, pcm, rate, piece_bytes=rate // 25))  # 20 ms pieces
    assert job.audio.pcm16 == pcm and job.audio_tokens is not None and job.audio_features is None
    whole = adapter.clip_tokens([AudioClip(pcm, rate)])[0]
    assert list(job.audio_tokens) == whole and len(whole) == 63  # 12.5 a second, the last one part-filled
    assert adapter.job_prompt(job) == adapter.job_prompt(dataclasses.replace(job, audio_tokens=None))
    assert replica.pieces[0].llm_replica == "" and all(p.llm_replica == TAG for p in replica.pieces[1:])
    assert [p.seq for p in replica.pieces] == list(range(len(replica.pieces))) and replica.pieces[-1].end
    assert b"".join(p.pcm16 for p in replica.pieces) == pcm and replica.turns.turns == {}


def test_a_replica_lost_mid_turn_leaves_the_job_the_whole_clip(adapter, caplog):
    pcm, replica = speech(2.0, 16_000), Replica(adapter, lost_after=3)
    job = asyncio.run(stream_turn(replica, pcm, 16_000, piece_bytes=640))
    assert job.audio.pcm16 == pcm and job.audio_tokens is None  # tokenized where the Job runs
    assert len(replica.pieces) == 4 and "the whole clip goes with the turn" in caplog.text


def test_a_replica_that_does_not_hold_the_turn_leaves_the_job_the_whole_clip(adapter):
    pcm, replica = speech(1.0, 16_000), Replica(adapter, max_turns=0)  # at its turn limit
    job = asyncio.run(stream_turn(replica, pcm, 16_000, piece_bytes=640))
    assert job.audio_tokens is None and len(replica.pieces) == 1  # nothing more sent after its refusal


@pytest.mark.parametrize("ending", ["silent", "idle"])
def test_an_abandoned_turn_is_dropped_on_its_replica(adapter, ending: str):
    replica = Replica(adapter)
    turn = MicTurn(GLM, SPEECH_IN, 16_000, MicFields(), ReplicaMicTokens(replica.send, "turn-2", 16_000))

    async def reading() -> None:
        for _ in range(4):
            turn.push(bytes(640) if ending == "silent" else speech(0.04, 16_000))
            await asyncio.sleep(0.005)
        if ending == "idle":
            raise IdleTimeout("no audio")

    with pytest.raises(InvalidArgumentError if ending == "silent" else IdleTimeout):
        asyncio.run(turn_job(make_job, FIELDS, turn, reading()))
    assert replica.pieces[-1].cancel and replica.turns.turns == {}


def test_the_replica_drops_a_piece_out_of_order_and_an_idle_turn(adapter):
    clock = [0.0]
    turns = MicTurns(adapter, max_turns=4, idle_s=10.0, clock=lambda: clock[0])
    pcm = speech(0.2, 16_000)
    assert turns.take(MicPiece("a", "", 16_000, 0, pcm), TAG) == MicTokens(TAG)
    assert turns.take(MicPiece("a", TAG, 16_000, 2, pcm), TAG) == MicTokens("")  # seq 1 never came
    assert turns.take(MicPiece("a", TAG, 16_000, 2, pcm), TAG) == MicTokens("") and turns.turns == {}
    assert turns.take(MicPiece("b", "", 16_000, 0, pcm), TAG) == MicTokens(TAG)
    clock[0] = 11.0  # its client left without a word
    assert turns.take(MicPiece("c", "", 16_000, 0, pcm), TAG) == MicTokens(TAG) and list(turns.turns) == ["c"]

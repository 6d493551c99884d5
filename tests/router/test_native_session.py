"""Native text streaming at the router (issue 27): `NativeTextSession` drives one streaming-text
request of the real in-process qwen3-tts-tiny engine, fed text pieces as they come; the idle
timeout, the drain (a stream only waiting for text ends cleanly) and the stream-level playback
clock; and the drain of a segment-pipelined `IncrementalSession`."""

from __future__ import annotations

import asyncio

import pytest

from cluster.pipeline import InProcessPipeline
from core.config import EngineConfig, IncrementalConfig, ModelConfig
from core.messages import Invalid, Job, TextPiece
from llm_stage.registry import get_entry
from router.incremental import IdleTimeout, SegmentAudio
from router.native_session import NativeTextSession, TextRoute
from router.playback import TextPacedPlayback
from tests.router.test_incremental import make_session

MODEL = "qwen3-tts-tiny"
WORDS = ["Hello ", "there, ", "my ", "good ", "friend. ", "How ", "are ", "you?"]
SAMPLING = {"seed": 7, "max_tokens": 40}
TAG = "LLMStage#local"


class LocalTextStream:
    """The cluster's two calls on one in-process pipeline: the streaming-text request's audio (its
    head names this "replica") and its text pieces; records how the engine held it meanwhile."""

    def __init__(self, model: str = MODEL) -> None:
        self.pipeline = InProcessPipeline(EngineConfig(model=ModelConfig(name=model)))
        self.jobs: list[Job] = []
        self.pieces: list[TextPiece] = []
        self.parts: list[SegmentAudio] = []
        self.frames: list = []  # every chunk's kept codec frames, in order
        self.max_requests = 0
        self.times_waited_for_text = 0  # the engine ran out of text (the paced feed counts it)

    async def run_stream(self, job: Job, route: TextRoute):
        self.jobs.append(job)
        self.pipeline.add_job(job)
        route.point_at(TAG)
        while True:
            while not self.parts:
                self._step()
                await asyncio.sleep(0.001)
            part = self.parts.pop(0)
            yield part
            if part.audio.is_final:
                return

    async def send_text(self, piece: TextPiece) -> bool | Invalid:
        assert piece.llm_replica == TAG
        self.pieces.append(piece)
        return self.pipeline.llm.push_text(piece)

    def _step(self) -> None:
        engine = self.pipeline.llm.engine
        self.max_requests = max(self.max_requests, len(engine.requests))
        for chunk in self.pipeline.step():
            frames = self.pipeline.take_frames(chunk)
            self.frames.extend(frames)
            self.parts.append(SegmentAudio(chunk, frames))


def make_native(
    draining: list[bool] | None = None, model: str = MODEL, voice: str | None = "ryan", **config
) -> tuple[NativeTextSession, LocalTextStream]:
    local = LocalTextStream(model)
    adapter = local.pipeline.llm.engine.adapter
    template = Job("nat-1", "-", voice, adapter.default_sampling.model_copy(update=SAMPLING), 5.0)
    flags = draining if draining is not None else [False]
    session = NativeTextSession(
        template, adapter, IncrementalConfig(**config), local.run_stream, local.send_text,
        get_entry(model).sample_rate_hz, is_draining=lambda: flags[0],
    )  # fmt: skip
    return session, local


async def collect(session, pieces: list[str], local: LocalTextStream | None = None) -> list:
    """The session's audio while `pieces` are pushed, each (after the first) only once the engine has
    run out of text and waits for it (`local` given), else all at once."""

    async def until(condition) -> None:  # or until the request is gone (an EOS before the text ended)
        engine = local.pipeline.llm.engine
        while not local.jobs:
            await asyncio.sleep(0.005)
        while not condition() and local.jobs[0].req_id in engine.requests:
            await asyncio.sleep(0.005)

    async def feed():
        scheduler = local.pipeline.llm.engine.scheduler if local is not None else None
        for index, piece in enumerate(pieces):
            if index > 0:
                await until(lambda: scheduler.num_waiting_for_text)
                local.times_waited_for_text += 1
            session.push(piece)
            if index > 0:
                await until(lambda: not scheduler.num_waiting_for_text)  # the piece reached the engine
        session.end()

    feeder = asyncio.create_task(feed())
    chunks = [c async for c in session.audio()]
    await feeder
    return chunks


def test_paced_words_make_one_request_that_waits_for_text_and_speaks_as_the_whole_text():
    session, local = make_native()
    chunks = asyncio.run(collect(session, WORDS, local))
    assert [c.audio.seq for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].audio.is_final and not any(c.audio.is_final for c in chunks[:-1])
    assert len(local.jobs) == 1 and local.jobs[0].text_streaming and local.max_requests == 1
    assert local.jobs[0].text == "Hello "  # the first piece opens it, the rest goes as pieces
    assert "".join(WORDS[1:]).startswith("".join(p.text for p in local.pieces))  # in order (up to an EOS)
    assert local.times_waited_for_text >= 3  # it ran ahead of the text and waited, KV held
    assert session.is_finished and session.playback.first_audio_s is not None
    # the same text all at once: the same codec frames (same positions, same seeded draws)
    whole, local_whole = make_native()
    asyncio.run(collect(whole, ["".join(WORDS)]))
    assert local.frames == local_whole.frames and len(local.frames) > len(WORDS)


def test_cosyvoice2_paced_words_wait_for_text_groups_and_speak_as_the_whole_text():
    """CosyVoice 2 (bistream): one request that waits for each 5-token text group, seeded RAS sampling
    (fill tokens forced, never output); the same audio as its text sent at once."""
    session, local = make_native(model="cosyvoice2-tiny", voice=None)
    chunks = asyncio.run(collect(session, WORDS, local))
    assert len(local.jobs) == 1 and local.jobs[0].text_streaming and local.times_waited_for_text >= 3
    assert chunks[-1].audio.is_final and session.is_finished
    whole, local_whole = make_native(model="cosyvoice2-tiny", voice=None)
    whole_chunks = asyncio.run(collect(whole, ["".join(WORDS)]))
    assert local.frames == local_whole.frames and len(local.frames) == SAMPLING["max_tokens"]
    got = b"".join(c.audio.pcm16 for c in chunks)
    assert got and got == b"".join(c.audio.pcm16 for c in whole_chunks)


def test_a_silent_client_is_closed_after_the_idle_timeout_once_no_audio_flows():
    session, local = make_native(idle_timeout_s=0.5)

    async def run():
        session.push("Hi there, ")
        got = []
        with pytest.raises(IdleTimeout, match="incremental.idle_timeout_s"):
            async for chunk in session.audio():
                got.append(chunk)
        return got

    got = asyncio.run(run())
    assert got and local.pipeline.llm.engine.scheduler.num_waiting_for_text == 1  # it waited, then was closed


def test_a_drain_ends_a_stream_waiting_for_text_with_its_final_chunk():
    draining = [False]
    session, local = make_native(draining, idle_timeout_s=30.0)

    async def drain_when_waiting():
        scheduler = local.pipeline.llm.engine.scheduler
        while not scheduler.num_waiting_for_text:  # the client is quiet and the stream ran out of text
            await asyncio.sleep(0.005)
        draining[0] = True

    async def run():
        session.push(WORDS[0])  # seed 7 speaks it without an EOS, then waits (as in the paced test)
        drainer = asyncio.ensure_future(drain_when_waiting())
        chunks = [chunk async for chunk in session.audio()]
        await drainer
        session.push("dropped: the stream has ended")  # a late piece is dropped, not an error
        return chunks

    chunks = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert chunks[-1].audio.is_final and session.is_drain_ended and session.is_finished
    assert local.pieces[-1].end and "dropped" not in "".join(p.text for p in local.pieces)


def test_segment_session_drain_ends_a_stream_waiting_for_text():
    draining = [False]
    session, runner = make_session("orpheus-tiny", {"seed": 1, "max_tokens": 14}, idle_timeout_s=30.0)
    session.is_draining = lambda: draining[0]

    async def run():
        session.push("Just one sentence. ")
        chunks = []
        async for chunk in session.audio():
            chunks.append(chunk)
            if chunk.is_segment_end and not chunk.audio.is_final:
                draining[0] = True
        return chunks

    chunks = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert chunks[-1].audio.is_final and session.is_drain_ended and len(runner.jobs) == 1


def test_text_paced_playback_restarts_its_clock_only_when_the_client_ran_dry_waiting_for_text():
    playback = TextPacedPlayback(start_s=0.0)
    assert playback.on_chunk(0.5, 1.0) is None and playback.ttfa_s == 0.5
    assert playback.on_chunk(1.2, 1.0) == 0.0  # on time: 2 s of audio by 2.5 s
    playback.on_text(2.0)  # text while audio still plays: the clock goes on
    assert playback.on_chunk(2.7, 1.0) == pytest.approx(0.2)  # a real underrun
    playback.on_text(9.0)  # the client let it run dry: its own silence
    assert playback.on_chunk(9.4, 1.0) is None and playback.on_chunk(9.9, 1.0) == 0.0
    assert playback.audio_sent_s == 5.0 and not playback.is_viable  # the underrun at 2.7 s stays

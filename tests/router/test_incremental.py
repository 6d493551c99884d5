"""Incremental text (issue 27): the segmenter, the click-free joins, and `IncrementalSession`
driving real in-process engines of the tiny Orpheus, CSM and Dia presets segment by segment."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cluster.pipeline import InProcessPipeline
from core.config import EngineConfig, IncrementalConfig, ModelConfig
from core.errors import InvalidArgumentError
from core.messages import AudioChunk, Job
from llm_stage.registry import get_entry
from router.incremental import IdleTimeout, IncrementalSession, SegmentAudio
from router.joins import fade_in, fade_out, fade_samples
from router.segmenter import TextSegmenter

TEXT = "Hello there, my good friend. How are you today? I am fine"
PIECES = [word + " " for word in TEXT.split(" ")]


# ---- segmenter --------------------------------------------------------------------------------
def test_segmenter_cuts_at_sentences_and_long_clauses_once_the_space_after_arrives():
    seg = TextSegmenter(min_clause_chars=10, max_segment_chars=60)
    assert seg.push("Hi, you. Pi is 3.") == ["Hi, you."]  # "3." may go on as "3.14": wait for what follows
    assert seg.push("14 and so on, more or less; right") == ["Pi is 3.14 and so on,", "more or less;"]
    assert seg.flush() == ["right"] and seg.flush() == []


def test_segmenter_cuts_a_long_run_without_boundaries_at_a_space():
    seg = TextSegmenter(min_clause_chars=10, max_segment_chars=20)
    assert seg.push("aaaa bbbb cccc dddd eeee ffff") == ["aaaa bbbb cccc dddd"]
    assert seg.buffer == " eeee ffff"


# ---- joins ------------------------------------------------------------------------------------
def test_fades_meet_zero_within_a_linear_envelope():
    loud = np.full(100, 30000, dtype="<i2").tobytes()
    out = np.frombuffer(fade_out(loud, 10), dtype="<i2")
    into = np.frombuffer(fade_in(loud, 10), dtype="<i2")
    assert out[-1] == 0 and into[0] == 0 and (out[:90] == 30000).all() and (into[10:] == 30000).all()
    assert np.abs(np.diff(out.astype(int))).max() <= 30000 / 10 + 1  # the joins' bound: full scale / ramp
    assert np.abs(np.diff(into.astype(int))).max() <= 30000 / 10 + 1


# ---- the session on real engines --------------------------------------------------------------
class LocalRunner:
    """Segments on one in-process pipeline, stepped from the event loop, each segment's chunks
    handed to its own generator (segments started ahead run in the same batch, as in the cluster)."""

    def __init__(self, model: str) -> None:
        self.pipeline = InProcessPipeline(EngineConfig(model=ModelConfig(name=model)))
        self.jobs: list[Job] = []
        self.rows_at_start: list[int] = []  # engine requests when each segment was queued
        self.parts: dict[str, list[SegmentAudio]] = {}

    async def __call__(self, job: Job):
        self.rows_at_start.append(len(self.pipeline.llm.engine.requests))
        self.jobs.append(job)
        self.parts[job.req_id] = []
        self.pipeline.add_job(job)
        while True:
            while not self.parts[job.req_id]:
                self._step()
                await asyncio.sleep(0)
            part = self.parts[job.req_id].pop(0)
            yield part
            if part.audio.is_final:
                return

    def _step(self) -> None:
        for chunk in self.pipeline.step():
            self.parts[chunk.req_id].append(SegmentAudio(chunk, self.pipeline.take_frames(chunk)))


def make_session(
    model: str, sampling: dict, voice: str | None = None, **config
) -> tuple[IncrementalSession, LocalRunner]:
    entry = get_entry(model)
    runner = LocalRunner(model)
    adapter = runner.pipeline.llm.engine.adapter
    params = adapter.default_sampling.model_copy(update=sampling)
    template = Job("inc-1", "-", voice or entry.default_voice, params, 5.0)
    config = IncrementalConfig(min_clause_chars=20, **config)
    return IncrementalSession(template, adapter, config, runner, entry.sample_rate_hz), runner


async def collect(session: IncrementalSession, pieces: list[str], pace_s: float = 0.001) -> list:
    """The session's audio while `pieces` are pushed `pace_s` apart (0: all before the first segment starts)."""

    async def feed():
        for piece in pieces:
            session.push(piece)
            if pace_s:
                await asyncio.sleep(pace_s)
        session.end()

    feeder = asyncio.create_task(feed())
    chunks = [c async for c in session.audio()]
    await feeder
    return chunks


def segment_pcm(chunks) -> list[np.ndarray]:
    by_segment: dict[int, bytes] = {}
    for c in chunks[:-1]:
        by_segment[c.segment_index] = by_segment.get(c.segment_index, b"") + c.audio.pcm16
    return [np.frombuffer(b, dtype="<i2").astype(np.int32) for _, b in sorted(by_segment.items())]


def check_stream_shape(chunks, num_segments: int, ramp: int) -> list[np.ndarray]:
    assert [c.audio.seq for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].audio.is_final and chunks[-1].audio.pcm16 == b""
    assert not any(c.audio.is_final for c in chunks[:-1])
    parts = segment_pcm(chunks)
    assert len(parts) == num_segments and all(len(p) > ramp for p in parts)
    joined = np.concatenate(parts)
    steepest = max(int(np.abs(np.diff(p[ramp:-ramp])).max()) for p in parts)  # the segments' own steps
    for k in range(1, num_segments):  # at every join both sides are 0, within the fades' linear envelope
        join = sum(len(p) for p in parts[:k])
        assert joined[join - 1] == 0 and joined[join] == 0
        window = joined[join - ramp : join + ramp]
        assert np.abs(np.diff(window)).max() <= steepest + 32767 / ramp + 1  # no step beyond the audio's own
    return parts


@pytest.mark.parametrize("lookahead", [0, 1])
def test_orpheus_segments_keep_voice_and_seed_and_equal_standalone_synthesis(lookahead):
    sampling = {"seed": 11, "max_tokens": 70}  # 10 frames: a segment ships chunks before it ends
    session, runner = make_session("orpheus-tiny", sampling, voice="leah", lookahead_segments=lookahead)
    chunks = asyncio.run(collect(session, PIECES, pace_s=0.0))
    ramp = fade_samples(24000, session.config.fade_ms)
    parts = check_stream_shape(chunks, 3, ramp)
    assert [j.text for j in runner.jobs] == ["Hello there, my good friend.", "How are you today?", "I am fine"]
    assert all(j.voice == "leah" and j.sampling.seed == 11 and not j.context for j in runner.jobs)
    if lookahead:  # the text was all there: each next segment started while the one before generated
        assert runner.rows_at_start[1:] == [1, 1]
    else:  # one at a time: nothing held in the engine between segments; later ones carry the client's buffer
        assert runner.rows_at_start == [0, 0, 0]
        assert runner.jobs[0].buffered_audio_s is None and all(j.buffered_audio_s > 0 for j in runner.jobs[1:])
    fresh = InProcessPipeline(EngineConfig(model=ModelConfig(name="orpheus-tiny")))
    for k, job in enumerate(runner.jobs):
        alone = np.frombuffer(fresh.synthesize(job.text, "leah", sampling), dtype="<i2").astype(np.int32)
        assert len(alone) == len(parts[k])
        body = slice(ramp if k else 0, len(alone) - ramp)  # the same audio outside the fades
        assert np.abs(alone[body] - parts[k][body]).max() <= 2  # same tokens; float noise of chunking / batching


def test_csm_later_segments_carry_the_earlier_turns_audio_frames():
    session, runner = make_session("csm-tiny", {"seed": 5, "max_tokens": 6}, voice="3", lookahead_segments=1)
    chunks = asyncio.run(collect(session, PIECES, pace_s=0.0))
    check_stream_shape(chunks, 3, fade_samples(24000, session.config.fade_ms))
    first, second, third = runner.jobs
    assert not first.context and [t.text for t in second.context] == [first.text]
    assert [t.text for t in third.context] == [first.text, second.text]
    assert len(second.context[0].frames) == 6 and all(len(f) == 8 for f in second.context[0].frames)
    assert all(j.voice == "3" for j in runner.jobs) and runner.rows_at_start == [0, 0, 0]  # never ahead: it waits
    adapter = runner.pipeline.llm.engine.adapter
    prompt = adapter.job_prompt(second)
    turn = adapter.context_turn(second.context[0])
    assert prompt[: len(turn)] == turn and len(turn) == len(adapter.format_prompt(first.text, "3")) + 6 + 1
    # the context changes what is generated: the same text without it gives other audio
    fresh = InProcessPipeline(EngineConfig(model=ModelConfig(name="csm-tiny")))
    alone = np.frombuffer(fresh.synthesize(second.text, "3", {"seed": 5, "max_tokens": 6}), dtype="<i2")
    assert not np.array_equal(alone, segment_pcm(chunks)[1].astype("<i2"))


def test_dia_untagged_segments_keep_the_last_speaker_tag():
    session, runner = make_session("dia-tiny", {"seed": 2, "max_tokens": 24})
    pieces = ["[S1] Hi ", "there. [S2] ", "Hello back. ", "How are you?"]
    chunks = asyncio.run(collect(session, pieces))
    check_stream_shape(chunks, 3, fade_samples(44100, session.config.fade_ms))
    assert [j.text for j in runner.jobs] == ["[S1] Hi there.", "[S2] Hello back.", "[S2] How are you?"]
    assert all(j.sampling.guidance_scale == 3.0 and j.sampling.seed == 2 for j in runner.jobs)


def test_idle_stream_holds_no_engine_row_and_is_closed_after_the_idle_timeout():
    session, runner = make_session("orpheus-tiny", {"seed": 1, "max_tokens": 14}, idle_timeout_s=0.3)

    async def run():
        session.push("Just one sentence. ")
        got, started = [], None
        with pytest.raises(IdleTimeout, match="incremental.idle_timeout_s"):
            async for chunk in session.audio():
                got.append(chunk)
                if chunk.is_segment_end:
                    started = asyncio.get_running_loop().time()
                    assert not runner.pipeline.llm.engine.requests  # waiting for text: no row, no deadline
        return got, asyncio.get_running_loop().time() - started

    got, waited_s = asyncio.run(run())
    assert len(got) >= 1 and 0.25 <= waited_s < 2.0


@pytest.mark.parametrize(
    ("call", "field", "message"),
    [
        (lambda s: s.push(5), "text", "must be a string"),
        (lambda s: s.push("x" * 1001), "text", "limit is 1000"),
        (lambda s: s.push("bell \x07"), "text", "control character"),
        (lambda s: (s.end(), s.push("late")), "text", "already ended"),
        (lambda s: (s.end(), s.flush()), "flush", "already ended"),
    ],
)
def test_bad_pieces_name_the_field(call, field, message):
    session, _ = make_session("orpheus-tiny", {})
    with pytest.raises(InvalidArgumentError, match=message) as err:
        call(session)
    assert err.value.field == field


def test_a_stream_closed_mid_segment_also_stops_the_segment_started_ahead():
    """Leaving mid-stream must free every segment's engine stream: the one playing and the one
    started ahead (here a runner whose segments never end, recording which were closed)."""
    entry = get_entry("orpheus-tiny")
    closed: list[str] = []

    async def endless(job: Job):
        try:
            seq = 0
            while True:
                await asyncio.sleep(0.01)
                yield SegmentAudio(AudioChunk(job.req_id, seq, b"\x01\x00" * 480, 24000, False), ((1,) * 7,))
                seq += 1
        finally:
            closed.append(job.req_id)

    async def run():
        template = Job("leave", "-", "tara", entry.family.lm.default_sampling, 5.0)
        session = IncrementalSession(template, entry.family.lm, IncrementalConfig(), endless, 24000)
        session.push("First sentence here. Second one here. ")

        async def consume():
            async for chunk in session.audio():
                if chunk.audio.seq == 3:
                    await asyncio.Event().wait()  # the client stops reading; then it leaves

        task = asyncio.create_task(consume())
        for _ in range(500):  # (0.2 s on a quiet box; a loaded one takes longer)
            if len(session.prefetches) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(session.prefetches) == 2  # the second segment was started ahead
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)

    asyncio.run(run())
    assert sorted(closed) == ["leave.0", "leave.1"]


def test_qwen3_tts_speaks_incrementally_through_the_segment_path():
    """No native text streaming yet: Qwen3-TTS goes segment by segment like the others."""
    session, runner = make_session("qwen3-tts-tiny", {"seed": 1, "max_tokens": 8})
    chunks = asyncio.run(collect(session, PIECES))
    parts = check_stream_shape(
        chunks, 3, fade_samples(get_entry("qwen3-tts-tiny").sample_rate_hz, session.config.fade_ms)
    )
    assert [len(p) for p in parts] == [8 * 1920] * 3 and all(j.voice == runner.jobs[0].voice for j in runner.jobs)

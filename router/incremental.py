"""An incremental-text stream, independent of its transport: text pieces, flush and end go in,
ordered audio comes out. The WebSocket endpoint drives it today; a gRPC bidi method can drive the
same object (config message -> `IncrementalSession`, text -> `push`, flush -> `flush`, end or
half-close -> `end`, `audio()` -> AudioChunks).

Text is cut into segments (`router.segmenter`); each segment is one Job with the stream's voice,
seed and sampling, carrying the context its family needs (CSM: earlier segments as turns; Dia: the
speaker tag; Orpheus: the voice prefix every prompt has), run by `run_segment`; a segment whose
text is complete starts while the one before still generates (`lookahead_segments`; CSM waits
for the audio it conditions on), its audio held until its turn. Waiting for text, nothing is
queued in the engine. Joins fade to zero (`router.joins`). No text for `idle_timeout_s` closes it;
a drain ends a stream waiting for text (its final chunk; later pieces are dropped). Families that
read text while they speak use `router.native_session` instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from core.config import IncrementalConfig
from core.errors import InvalidArgumentError
from core.messages import AudioChunk, ContextTurn, Job
from llm_stage.jobs import check_text, check_unicode
from llm_stage.models.base import LMAdapter
from router.joins import fade_in, fade_out, fade_samples
from router.playback import TextPacedPlayback
from router.segmenter import TextSegmenter

END = None  # queued after the last segment
DRAIN_POLL_S = 0.1  # while waiting for text: how often a drain is looked for


def check_piece(text: object, field: str, config: IncrementalConfig) -> None:
    """A client's text piece: a string within `max_piece_chars`, valid Unicode."""
    if not isinstance(text, str):
        raise InvalidArgumentError(field, "must be a string")
    if len(text) > config.max_piece_chars:
        raise InvalidArgumentError(field, f"is {len(text)} characters; the limit is {config.max_piece_chars}")
    check_unicode(text, field)


@dataclass(frozen=True)
class SegmentAudio:
    """One chunk of a segment's audio and the codec frames it covers (kept as context)."""

    audio: AudioChunk
    frames: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class SessionAudio:
    """One chunk of the stream: seq continues across segments; the last chunk is an empty final one."""

    audio: AudioChunk
    segment_index: int
    is_segment_end: bool
    segment_text: str = ""  # on a segment's first chunk: the text it speaks, as cut from the client's pieces


SegmentRunner = Callable[[Job], AsyncIterator[SegmentAudio]]


class IdleTimeout(Exception):
    """The client sent no text for `idle_timeout_s` while the stream had nothing left to speak."""


class Prefetch:
    """A segment started ahead: a task collects its chunks while the segment before it plays out."""

    def __init__(self, parts: AsyncIterator[SegmentAudio]) -> None:
        self.items: asyncio.Queue[SegmentAudio | Exception | None] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._pump(parts))

    async def _pump(self, parts: AsyncIterator[SegmentAudio]) -> None:
        try:
            async for part in parts:
                self.items.put_nowait(part)
            self.items.put_nowait(None)
        except Exception as err:  # raised where its audio is due
            self.items.put_nowait(err)

    async def parts(self) -> AsyncIterator[SegmentAudio]:
        while (item := await self.items.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item


Segment = tuple[Job, AsyncIterator[SegmentAudio]]  # a started segment: its job and its chunks


class IncrementalSession:
    def __init__(
        self,
        template: Job,
        adapter: type[LMAdapter] | LMAdapter,
        config: IncrementalConfig,
        run_segment: SegmentRunner,
        sample_rate_hz: int,
        clock: Callable[[], float] = time.monotonic,
        is_draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.template = template  # validated once: voice, sampling, deadline, format, request id
        self.adapter = adapter
        self.config = config
        self.run_segment = run_segment
        self.sample_rate_hz = sample_rate_hz
        self.clock = clock
        self.segmenter = TextSegmenter(config.min_clause_chars, config.max_segment_chars)
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.texts: list[str] = []  # the segments as the model read them
        self.cut_texts: list[str] = []  # the segments as cut from the client's text
        self.turns: list[ContextTurn] = []
        self.is_ended = False
        self.is_draining = is_draining
        self.is_drain_ended = False  # the drain ended the text: later pieces are dropped
        self.is_finished = False  # the final chunk went out
        self.playback = TextPacedPlayback(clock())  # the whole stream's, for the Router's metrics
        self.last_activity_s = clock()
        self.next_seq = 0
        self.first_audio_s: float | None = None  # when the stream's first audio left the session
        self.audio_sent_s = 0.0
        self.lookahead = 0 if adapter.uses_context_turns else config.lookahead_segments
        self.ahead: deque[Segment | None] = deque()  # segments started ahead, then END once taken
        self.prefetches: list[Prefetch] = []

    # ---- input --------------------------------------------------------------------------
    def push(self, text: object, field: str = "text") -> None:
        """A piece of text; complete segments are queued for synthesis."""
        if self.is_drain_ended:
            return
        self._check_open(field)
        check_piece(text, field, self.config)
        self.last_activity_s = self.clock()
        self.playback.on_text(self.last_activity_s)
        self._queue(self.segmenter.push(text))  # type: ignore[arg-type]

    def flush(self) -> None:
        """Speak what is buffered now, without waiting for a boundary."""
        if self.is_drain_ended:
            return
        self._check_open("flush")
        self.last_activity_s = self.clock()
        self._queue(self.segmenter.flush())

    def end(self) -> None:
        """No more text: the buffered rest is spoken, then the stream ends (a second end is a no-op)."""
        if self.is_ended:
            return
        self._queue(self.segmenter.flush())
        self.is_ended = True
        self.queue.put_nowait(END)

    def _mark_sent(self, duration_s: float) -> None:
        if self.first_audio_s is None and duration_s > 0:
            self.first_audio_s = self.clock()
        self.audio_sent_s += duration_s

    def _check_open(self, field: str) -> None:
        if self.is_ended:
            raise InvalidArgumentError(field, "the stream has already ended")

    def _queue(self, segments: list[str]) -> None:
        for segment in segments:
            self.queue.put_nowait(segment)

    # ---- output -------------------------------------------------------------------------
    async def audio(self) -> AsyncIterator[SessionAudio]:
        """Every segment's audio in order, then one empty final chunk once the stream has ended."""
        try:
            while (segment := await self._take_segment()) is not END:
                job, parts = segment
                async for chunk in self._segment_audio(job, parts):
                    yield chunk
                    self._start_ahead()
                self.last_activity_s = self.clock()  # waiting for text starts now
        finally:  # a stream closed early cancels the segments started ahead (their streams are freed)
            for prefetch in self.prefetches:
                prefetch.task.cancel()
        self.is_finished = True
        final = AudioChunk(self.template.req_id, self.next_seq, b"", self.sample_rate_hz, is_final=True)
        yield SessionAudio(final, len(self.texts), is_segment_end=True)

    async def _take_segment(self) -> Segment | None:
        """The next segment to play: one started ahead, else the next text cut (waiting for it)."""
        self._start_ahead()
        if self.ahead:
            return self.ahead.popleft()
        segment = await self._next_segment()
        if segment is END:
            return END
        job = self._segment_job(segment)
        return job, self.run_segment(job)

    def _start_ahead(self) -> None:
        """Start the segments whose text is complete, up to `lookahead` ahead of the one playing."""
        while len(self.ahead) < self.lookahead and END not in self.ahead and not self.queue.empty():
            segment = self.queue.get_nowait()
            if segment is END:
                self.ahead.append(END)
                return
            job = self._segment_job(segment)
            self.prefetches.append(Prefetch(self.run_segment(job)))
            self.ahead.append((job, self.prefetches[-1].parts()))

    async def _next_segment(self) -> str | None:
        timeout_s = self.config.idle_timeout_s
        while True:
            if self.is_draining() and not self.is_ended:  # only waiting for text: end it cleanly
                self.end()
                self.is_drain_ended = True
            left_s = self.last_activity_s + timeout_s - self.clock()
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=min(max(left_s, 0.0), DRAIN_POLL_S))
            except TimeoutError:
                if self.clock() - self.last_activity_s >= timeout_s:
                    message = f"no text for {timeout_s:g} s (incremental.idle_timeout_s); stream closed"
                    raise IdleTimeout(message) from None

    def _segment_job(self, segment: str) -> Job:
        index = len(self.texts)
        self.cut_texts.append(segment)
        text = check_text(self.adapter, self.adapter.continue_text(segment, tuple(self.texts)), "text")
        self.texts.append(text)
        keep = self.config.max_context_turns if self.adapter.uses_context_turns else 0
        context = tuple(self.turns[-keep:]) if keep else ()
        req_id = f"{self.template.req_id}.{index}"
        job = dataclasses.replace(self.template, req_id=req_id, text=text, segment_index=index, context=context)
        return dataclasses.replace(job, buffered_audio_s=self.buffered_audio_s())

    def buffered_audio_s(self) -> float | None:
        """Audio the client holds unplayed now (None before the first audio: startup)."""
        if self.first_audio_s is None:
            return None
        return max(0.0, self.first_audio_s + self.audio_sent_s - self.clock())

    async def _segment_audio(self, job: Job, parts: AsyncIterator[SegmentAudio]) -> AsyncIterator[SessionAudio]:
        """One segment's chunks, renumbered into the stream, with the joins faded."""
        ramp = fade_samples(self.sample_rate_hz, self.config.fade_ms)
        frames: list[tuple[int, ...]] = []
        is_first = True
        async for part in parts:
            frames.extend(part.frames)
            pcm16 = part.audio.pcm16
            if is_first and job.segment_index > 0:
                pcm16 = fade_in(pcm16, ramp)
            if part.audio.is_final:
                pcm16 = fade_out(pcm16, ramp)
            audio = dataclasses.replace(
                part.audio, req_id=self.template.req_id, seq=self.next_seq, pcm16=pcm16, is_final=False
            )
            self.next_seq += 1
            self._mark_sent(audio.duration_s)
            self.playback.on_chunk(self.clock(), audio.duration_s)
            cut_text = self.cut_texts[job.segment_index] if is_first else ""
            is_first = False
            yield SessionAudio(audio, job.segment_index, part.audio.is_final, cut_text)
            if part.audio.is_final:
                break
        self.turns.append(ContextTurn(job.text, job.voice, tuple(frames)))

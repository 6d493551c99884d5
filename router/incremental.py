"""An incremental-text stream, independent of its transport: text pieces, flush and end go in,
ordered audio comes out. The WebSocket endpoint drives it today; a gRPC bidi method can drive the
same object (config message -> `IncrementalSession`, text -> `push`, flush -> `flush`, end or
half-close -> `end`, `audio()` -> AudioChunks).

Text is cut into segments (`router.segmenter`); each segment is one Job with the stream's voice,
seed and sampling, run to its end by `run_segment` before the next one starts, carrying the
context its family needs (CSM: earlier segments as turns; Dia: the speaker tag; Orpheus: the voice
prefix every prompt has). Between segments nothing is queued in the engine. Joins fade to zero
(`router.joins`). A stream waiting `idle_timeout_s` for text is closed with `IdleTimeout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from core.config import IncrementalConfig
from core.errors import InvalidArgumentError
from core.messages import AudioChunk, ContextTurn, Job
from llm_stage.jobs import check_text, check_unicode
from llm_stage.models.base import LMAdapter
from router.joins import fade_in, fade_out, fade_samples
from router.segmenter import TextSegmenter

END = None  # queued after the last segment


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


class IncrementalSession:
    def __init__(
        self,
        template: Job,
        adapter: type[LMAdapter] | LMAdapter,
        config: IncrementalConfig,
        run_segment: SegmentRunner,
        sample_rate_hz: int,
        clock: Callable[[], float] = time.monotonic,
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
        self.last_activity_s = clock()
        self.next_seq = 0

    # ---- input --------------------------------------------------------------------------
    def push(self, text: object, field: str = "text") -> None:
        """A piece of text; complete segments are queued for synthesis."""
        self._check_open(field)
        if not isinstance(text, str):
            raise InvalidArgumentError(field, "must be a string")
        if len(text) > self.config.max_piece_chars:
            raise InvalidArgumentError(field, f"is {len(text)} characters; the limit is {self.config.max_piece_chars}")
        check_unicode(text, field)
        self.last_activity_s = self.clock()
        self._queue(self.segmenter.push(text))

    def flush(self) -> None:
        """Speak what is buffered now, without waiting for a boundary."""
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

    def _check_open(self, field: str) -> None:
        if self.is_ended:
            raise InvalidArgumentError(field, "the stream has already ended")

    def _queue(self, segments: list[str]) -> None:
        for segment in segments:
            self.queue.put_nowait(segment)

    # ---- output -------------------------------------------------------------------------
    async def audio(self) -> AsyncIterator[SessionAudio]:
        """Every segment's audio in order, then one empty final chunk once the stream has ended."""
        while (segment := await self._next_segment()) is not END:
            async for chunk in self._segment_audio(self._segment_job(segment)):
                yield chunk
            self.last_activity_s = self.clock()  # waiting for text starts now
        final = AudioChunk(self.template.req_id, self.next_seq, b"", self.sample_rate_hz, is_final=True)
        yield SessionAudio(final, len(self.texts), is_segment_end=True)

    async def _next_segment(self) -> str | None:
        timeout_s = self.config.idle_timeout_s
        while True:
            left_s = self.last_activity_s + timeout_s - self.clock()
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=max(left_s, 0.0))
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
        return dataclasses.replace(self.template, req_id=req_id, text=text, segment_index=index, context=context)

    async def _segment_audio(self, job: Job) -> AsyncIterator[SessionAudio]:
        """One segment's chunks, renumbered into the stream, with the joins faded."""
        ramp = fade_samples(self.sample_rate_hz, self.config.fade_ms)
        frames: list[tuple[int, ...]] = []
        is_first = True
        async for part in self.run_segment(job):
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
            cut_text = self.cut_texts[job.segment_index] if is_first else ""
            is_first = False
            yield SessionAudio(audio, job.segment_index, part.audio.is_final, cut_text)
            if part.audio.is_final:
                break
        self.turns.append(ContextTurn(job.text, job.voice, tuple(frames)))

"""An incremental-text stream for a family that reads text while it speaks (`ModelFamily.streams_text`,
e.g. Qwen3-TTS): one LLM request for the whole stream, opened on the first text, then fed every
later piece (`TextPiece`, in order, coalesced while one is in flight) on the replica running it.
The request waits there for text holding its KV and no batch row. Same interface as
`IncrementalSession` (push / flush / end in, `audio()` out), so the WebSocket and gRPC bidi
endpoints drive either; `RouterCore.incremental` picks by family.

If the request stops first (the model's EOS, or `max_tokens`) while the client still sends text,
the text that comes after opens another request (segment 1, 2, ...; text sent to the stopped one
and not read by it is not spoken, as the reference stops there too). No text for `idle_timeout_s`
while no audio flows closes it (IdleTimeout); a drain ends its text (what it holds is spoken, then
the final chunk; later pieces are dropped).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from core.config import IncrementalConfig
from core.errors import InvalidArgumentError
from core.messages import AudioChunk, Invalid, Job, TextPiece
from llm_stage.jobs import check_text
from llm_stage.models.base import LMAdapter
from router.incremental import IdleTimeout, SegmentAudio, SessionAudio, check_piece
from router.playback import TextPacedPlayback

WATCH_S = 0.1  # how often the idle timeout and the drain are looked at


class TextRoute:
    """Where a streaming-text request's pieces go, and every piece sent so far: the LLM replica
    running it (its head event names it), or none while the request resumes on another replica
    after losing its own (`lose`: the pieces sent until then are replayed into the new replica's
    feed; later ones wait for its head and go there). Every piece is logged before it is sent,
    so a piece in flight to a lost replica is replayed, never dropped; that replica's tag on it
    keeps any other from taking it twice."""

    def __init__(self) -> None:
        self.replica: str | None = None
        self.sent: list[TextPiece] = []
        self._known = asyncio.Event()

    def point_at(self, replica: str) -> None:
        self.replica = replica
        self._known.set()

    def lose(self) -> tuple[TextPiece, ...]:
        """The replica is lost: the pieces to replay; later ones wait for the next `point_at`."""
        self.replica = None
        self._known.clear()
        return tuple(self.sent)

    async def piece(self, req_id: str, text: str, flush: bool, end: bool) -> TextPiece:
        """The next piece, addressed to the replica running the request (once one is), and logged."""
        await self._known.wait()
        piece = TextPiece(req_id, self.replica, text, flush, end)  # type: ignore[arg-type]
        self.sent.append(piece)
        return piece

    async def moved_on_from(self, replica: str) -> None:
        """Wait until the request runs on another replica than `replica`."""
        while self.replica == replica or self.replica is None:
            await asyncio.sleep(WATCH_S)


# (the streaming-text job, its route: the runner points it at the LLM replica running it) -> its audio
TextStreamRunner = Callable[[Job, TextRoute], AsyncIterator[SegmentAudio]]
TextSender = Callable[[TextPiece], Awaitable[bool | Invalid]]


class NativeTextSession:
    def __init__(
        self,
        template: Job,
        adapter: type[LMAdapter] | LMAdapter,
        config: IncrementalConfig,
        run_stream: TextStreamRunner,
        send_text: TextSender,
        sample_rate_hz: int,
        is_draining: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.template = template
        self.adapter = adapter
        self.config = config
        self.run_stream = run_stream
        self.send_text = send_text
        self.sample_rate_hz = sample_rate_hz
        self.is_draining = is_draining
        self.clock = clock
        self.pieces: list[str] = []  # text not sent yet
        self.is_flush_due = False
        self.is_ended = False
        self.is_drain_ended = False  # the drain ended the text: later pieces are dropped
        self.is_finished = False  # the final chunk went out
        self.has_input = asyncio.Event()
        self.last_activity_s = clock()
        self.next_seq = 0
        self.playback = TextPacedPlayback(clock())

    # ---- input --------------------------------------------------------------------------
    def push(self, text: object, field: str = "text") -> None:
        if self.is_drain_ended:
            return
        self._check_open(field)
        check_piece(text, field, self.config)
        self.last_activity_s = self.clock()
        self.playback.on_text(self.last_activity_s)
        self.pieces.append(text)  # type: ignore[arg-type]
        self.has_input.set()

    def flush(self) -> None:
        if self.is_drain_ended:
            return
        self._check_open("flush")
        self.last_activity_s = self.clock()
        self.is_flush_due = True
        self.has_input.set()

    def end(self) -> None:
        self.is_ended = True
        self.has_input.set()

    def _check_open(self, field: str) -> None:
        if self.is_ended:
            raise InvalidArgumentError(field, "the stream has already ended")

    # ---- output -------------------------------------------------------------------------
    async def audio(self) -> AsyncIterator[SessionAudio]:
        """The stream's audio, then one empty final chunk once it has ended."""
        index = 0
        while (first := await self._first_text()) is not None:
            async for part in self._stream(first, index):
                yield part
            index += 1
        self.is_finished = True
        final = AudioChunk(self.template.req_id, self.next_seq, b"", self.sample_rate_hz, is_final=True)
        yield SessionAudio(final, index, is_segment_end=True)

    async def _first_text(self) -> str | None:
        """The text that opens the request: everything sent until it holds a word (None: it ended blank)."""
        while True:
            text = "".join(self.pieces)
            if text.strip():
                self.pieces.clear()
                return text
            if self.is_ended:
                return None
            self.has_input.clear()
            await self._watch(asyncio.ensure_future(self.has_input.wait()))

    async def _stream(self, first: str, index: int) -> AsyncIterator[SessionAudio]:
        """One streaming-text request (`index`: how many stopped before it) to its final chunk."""
        text = check_text(self.adapter, first, "text")
        req_id = self.template.req_id if index == 0 else f"{self.template.req_id}.{index}"
        buffered_s = max(0.0, self._last_audio_s() - self.clock()) if self.playback.period_start_s is not None else None
        job = dataclasses.replace(
            self.template, req_id=req_id, text=text, segment_index=index, text_streaming=True,
            buffered_audio_s=buffered_s,
        )  # fmt: skip
        route = TextRoute()
        sender = asyncio.ensure_future(self._send_loop(job.req_id, route))
        parts = self.run_stream(job, route)
        is_first = True
        try:
            while True:
                try:
                    part = await self._watch(asyncio.ensure_future(anext(parts)), sender)
                except StopAsyncIteration:
                    return
                audio = dataclasses.replace(part.audio, req_id=self.template.req_id, seq=self.next_seq, is_final=False)
                self.next_seq += 1
                self.playback.on_chunk(self.clock(), audio.duration_s)
                yield SessionAudio(audio, index, part.audio.is_final, first if is_first else "")
                is_first = False
                if part.audio.is_final:
                    return
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            await parts.aclose()

    async def _watch(self, waiting: asyncio.Future, sender: asyncio.Future | None = None):
        """`waiting`'s result; meanwhile a failed sender fails the stream, no text for the idle timeout
        (and no audio coming) closes it, and a drain ends the text."""
        watched = {waiting} if sender is None else {waiting, sender}
        try:
            while True:
                done, _ = await asyncio.wait(watched, timeout=WATCH_S, return_when=asyncio.FIRST_COMPLETED)
                if waiting in done:
                    return waiting.result()
                if sender is not None and sender in done:
                    sender.result()  # raises what failed it
                    watched.discard(sender)  # it sent the end: nothing more to watch there
                if self.is_ended:
                    continue
                if self.is_draining():
                    self.is_drain_ended = True
                    self.end()
                    continue
                idle_since_s = max(self.last_activity_s, self._last_audio_s())
                if self.clock() - idle_since_s >= self.config.idle_timeout_s:
                    timeout_s = self.config.idle_timeout_s
                    raise IdleTimeout(f"no text for {timeout_s:g} s (incremental.idle_timeout_s); stream closed")
        finally:
            if not waiting.done():
                waiting.cancel()

    def _last_audio_s(self) -> float:
        """When the audio the client holds runs out (the stream's start before any audio)."""
        playback = self.playback
        if playback.period_start_s is None:
            return playback.start_s
        return playback.period_start_s + playback.period_audio_s

    async def _send_loop(self, req_id: str, route: TextRoute) -> None:
        """Send the pieces in order, one call at a time (what queues meanwhile goes as one piece),
        to the replica running the request; ends after sending the end. A replica that no longer
        has the request either finished it (then the stream ends and cancels this) or was lost
        (then the request resumes elsewhere with this piece replayed: sending goes on there)."""
        while True:
            await self.has_input.wait()
            self.has_input.clear()
            text, flush, end = "".join(self.pieces), self.is_flush_due, self.is_ended
            self.pieces.clear()
            self.is_flush_due = False
            if not (text or flush or end):
                continue
            piece = await route.piece(req_id, text, flush, end)
            taken = await self.send_text(piece)
            if isinstance(taken, Invalid):
                raise InvalidArgumentError(taken.field, taken.message)
            if end:
                return
            if not taken:
                await route.moved_on_from(piece.llm_replica)

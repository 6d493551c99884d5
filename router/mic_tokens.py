"""A streamed microphone turn's pieces forwarded to an LLM replica that tokenizes them as they come
(families with `LMAdapter.tokenizes_mic_audio`: GLM-4-Voice, whose speech tokenizer needs the model's
weights), so the turn's speech tokens are ready when the user stops talking. Pieces go in order, one
call at a time (those that arrive meanwhile go together in the next); the first goes to any replica,
the later ones to the replica its reply named (`MicPiece`). Any failure (the replica lost, a turn it
could not hold) ends the forwarding, logged: the turn's Job then carries the whole clip, tokenized
where it runs. Used by `router.mic_turn.MicTurn`; the sender is `RouterCore.send_mic_piece`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from core.messages import MicPiece, MicTokens

logger = logging.getLogger(__name__)

MicSender = Callable[[MicPiece], Awaitable[MicTokens]]


class ReplicaMicTokens:
    """One turn's forwarding: `push` each checked piece (from the event loop), then `tokens` at the turn's
    end, or `cancel` when it is abandoned."""

    def __init__(self, send: MicSender, turn_id: str, sample_rate_hz: int) -> None:
        self.send, self.turn_id, self.sample_rate_hz = send, turn_id, sample_rate_hz
        self.replica = ""  # the LLM replica holding the turn, once its first piece's reply named it
        self.is_failed = False
        self.is_done = False  # its tokens were asked for, or it was cancelled
        self._buffered = bytearray()
        self._seq = 0
        self._sending: asyncio.Task | None = None

    def push(self, pcm16: bytes) -> None:
        """A piece of the turn: sent now, or with the next call if one is in flight."""
        if self.is_failed or self.is_done:
            return
        self._buffered += pcm16
        if self._sending is None or self._sending.done():
            self._sending = asyncio.get_running_loop().create_task(self._send_buffered())

    async def tokens(self) -> tuple[int, ...] | None:
        """The turn's speech tokens, once what was pushed is in (None: the forwarding failed)."""
        await self._settle()
        self.is_done = True
        if self.is_failed:
            return None
        reply = await self._send(end=True)
        return reply.tokens if reply is not None else None

    async def cancel(self) -> None:
        """The turn is abandoned (the client left, or its audio was refused): its replica drops it."""
        if self.is_done:
            return
        self.is_done = True
        await self._settle()
        if self.replica and not self.is_failed:
            await self._send(cancel=True)

    async def _settle(self) -> None:
        if self._sending is not None:
            await asyncio.shield(self._sending)

    async def _send_buffered(self) -> None:
        while self._buffered and not self.is_failed:
            await self._send()

    async def _send(self, end: bool = False, cancel: bool = False) -> MicTokens | None:
        pcm16, self._buffered = bytes(self._buffered), bytearray()
        piece = MicPiece(self.turn_id, self.replica, self.sample_rate_hz, self._seq, pcm16, end=end, cancel=cancel)
        self._seq += 1
        try:
            reply = await self.send(piece)
        except Exception as err:  # (lost replica, Serve's errors): the whole clip goes with the Job instead
            return None if cancel else self._fail(f"{type(err).__name__}: {err}")
        if not reply.llm_replica or (self.replica and reply.llm_replica != self.replica):
            return None if cancel else self._fail(f"{reply.llm_replica or 'the replica'} does not hold it")
        self.replica = reply.llm_replica
        return reply

    def _fail(self, why: str) -> None:
        if not self.is_failed:
            logger.warning("turn %s: tokenizing on an LLM replica stopped (%s): the whole clip goes with the turn",
                           self.turn_id, why)  # fmt: skip
        self.is_failed = True
        return None

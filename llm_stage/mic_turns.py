"""Microphone turns an LLM replica tokenizes as their audio arrives, for a family whose speech tokenizer
needs the model's weights (`LMAdapter.tokenizes_mic_audio`: GLM-4-Voice). One `MicAudioTokenizer` per
turn is fed the turn's `MicPiece`s in order, so at the end of the turn only its last block is left to
encode; the tokens go back to the Router, which puts them in the turn's Job (`Job.audio_tokens`), so
any replica can answer it. A turn this replica cannot hold (a piece out of order, the turn limit, no
tokenizer here, audio its tokenizer refuses) is answered `MicTokens("")`: the Router then sends the
whole clip, tokenized where the Job runs. Called by `deployments.llm_stage.LLMStage.mic_piece`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from core.errors import InvalidArgumentError
from core.messages import MicPiece, MicTokens
from llm_stage.models.base import LMAdapter, MicAudioTokenizer


@dataclass
class _Turn:
    tokenizer: MicAudioTokenizer
    next_seq: int = 0
    last_piece_s: float = 0.0


class MicTurns:
    """The turns open on one replica (at most `max_turns`; one idle for `idle_s` is dropped: its client
    left without a word). `take` may be called from several threads, each turn's pieces one at a time."""

    def __init__(
        self, adapter: LMAdapter, max_turns: int, idle_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.adapter, self.max_turns, self.idle_s, self.clock = adapter, max_turns, idle_s, clock
        self.turns: dict[str, _Turn] = {}
        self.num_tokenized = 0  # turns whose tokens went back
        self._lock = threading.Lock()  # the dict; a turn's own encoding runs outside it

    def take(self, piece: MicPiece, replica_tag: str) -> MicTokens:
        """Feed `piece` to its turn (opened by its first piece), and at its end give the turn's tokens.
        Blocking (it encodes): run it off the event loop."""
        turn = self._turn_for(piece)
        if turn is None:
            return MicTokens("")
        try:
            if piece.pcm16:
                turn.tokenizer.push_pcm16(piece.pcm16)
            tokens = turn.tokenizer.finish() if piece.end else None
        except InvalidArgumentError:  # the whole clip, checked where its Job runs, names the field
            self._drop(piece.turn_id)
            return MicTokens("")
        if tokens is None:
            return MicTokens(replica_tag)
        self._drop(piece.turn_id)
        self.num_tokenized += 1
        return MicTokens(replica_tag, tuple(int(token) for token in tokens.tolist()))

    def _turn_for(self, piece: MicPiece) -> _Turn | None:
        """The piece's turn, opened by its first piece; None (the turn dropped) when it cannot go on here."""
        now_s = self.clock()
        with self._lock:
            self._expire(now_s)
            if piece.cancel:
                self.turns.pop(piece.turn_id, None)
                return None
            turn = self.turns.get(piece.turn_id)
            if turn is None and piece.seq == 0 and len(self.turns) < self.max_turns:
                tokenizer = self.adapter.mic_tokenizer(piece.sample_rate_hz)
                if tokenizer is not None:
                    turn = self.turns[piece.turn_id] = _Turn(tokenizer)
            if turn is None or piece.seq != turn.next_seq:
                self.turns.pop(piece.turn_id, None)
                return None
            turn.next_seq, turn.last_piece_s = turn.next_seq + 1, now_s
            return turn

    def _expire(self, now_s: float) -> None:
        for turn_id in [tid for tid, turn in self.turns.items() if now_s - turn.last_piece_s > self.idle_s]:
            del self.turns[turn_id]

    def _drop(self, turn_id: str) -> None:
        with self._lock:
            self.turns.pop(turn_id, None)

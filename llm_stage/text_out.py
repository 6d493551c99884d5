"""The answer's text, streamed beside its audio (speech-in families): per request, the text ids the
LM drew become `TextDelta`s as they are decoded, one per step that added text.

Decoding is incremental over the whole id list (a BPE or byte token may end mid character): a
trailing replacement character is held back until the next ids complete it. `LLMSide` feeds it
after every engine step; the LLMStage deployment and the in-process pipeline take the deltas.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from core.messages import Checkpoint, TextDelta

INCOMPLETE = "\ufffd"  # what a decoder gives for a UTF-8 sequence cut short


class TextStream:
    """One request's text ids so far and the text already sent."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.sent = ""

    def push(self, ids: list[int], is_final: bool) -> str:
        """The text `ids` add (held back while it ends mid character, unless `is_final`)."""
        self.ids += ids
        text = self.decode(self.ids)
        if not is_final:
            text = text.rstrip(INCOMPLETE)
        if not text.startswith(self.sent):  # a decoder that rewrote earlier text: send only what is new
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


class TextStreams:
    """Every running request's TextStream; `push` after each step, `take` the deltas made since."""

    def __init__(self, decode: Callable[[list[int]], str], clock: Callable[[], float] = time.monotonic) -> None:
        self.decode, self.clock = decode, clock
        self.streams: dict[str, TextStream] = {}
        self.pending: list[TextDelta] = []

    def push(
        self, req_id: str, ids: list[int], is_final: bool, checkpoint: Callable[[], Checkpoint | None] | None = None
    ) -> None:
        """A step's text ids of `req_id`; a delta for what they add carries `checkpoint()` (not a final one)."""
        if not ids and not is_final and req_id not in self.streams:
            return
        stream = self.streams.setdefault(req_id, TextStream(self.decode))
        text = stream.push(ids, is_final)
        if is_final:
            del self.streams[req_id]
        if text or is_final:
            delta = TextDelta(req_id, text, is_final, self.clock())
            if checkpoint is not None and not is_final:
                delta = dataclasses.replace(delta, checkpoint=checkpoint())
            self.pending.append(delta)

    def resume(self, req_id: str, ids: list[int]) -> None:
        """A resumed stream's text ids so far: their text was sent (but a character they end mid-way, which
        the next ids complete)."""
        stream = self.streams[req_id] = TextStream(self.decode)
        stream.ids, stream.sent = list(ids), self.decode(list(ids)).rstrip(INCOMPLETE)

    def drop(self, req_id: str) -> None:
        self.streams.pop(req_id, None)

    def take(self) -> list[TextDelta]:
        taken, self.pending = self.pending, []
        return taken

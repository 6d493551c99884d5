"""Text streamed into a running request (native text streaming, e.g. Qwen3-TTS' streaming-text mode).

A `TextFeed` turns the text pieces a client sends into the text ids the request's positions read,
one id per position from `first_position` on: the committed ids, then the family's end ids, then
its pad id for ever once the text has ended. Pieces are tokenized as they come, holding back what
a later piece could still change (`SplitText`). Pure Python; the scheduler asks how far the text
reaches (`ready_through`) and the adapter reads the ids (`at`). Created by the engine's `add_job`. A family
whose text positions sit between its sampled tokens subclasses it to lay them out itself
(`ready_through` then says where the request waits; CosyVoice 2's `BistreamFeed`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

# (text not yet tokenized, whether more may follow) -> (ids that are final, the text held back)
SplitText = Callable[[str, bool], tuple[list[int], str]]
NO_LIMIT = sys.maxsize  # positions an ended feed can serve


@dataclass
class TextFeed:
    split: SplitText
    end_ids: tuple[int, ...]  # read once after the last text id (Qwen3-TTS: tts_eos)
    pad_id: int  # read by every later position (Qwen3-TTS: tts_pad)
    first_position: int = 0  # the absolute position that reads id 0 (set when the prompt is built)
    ids: list[int] = field(default_factory=list)
    held_text: str = ""  # text received, not tokenized for good yet
    is_ended: bool = False
    num_chars: int = 0  # text received in all (for limits)

    def push(self, text: str) -> int:
        """Take a piece; returns how many ids became final."""
        self.num_chars += len(text)
        self.held_text += text
        return self._commit(is_final=False)

    def flush(self) -> int:
        """Tokenize everything held back now (the client says no more text comes for a while)."""
        return self._commit(is_final=True)

    def end(self) -> int:
        """No more text: the rest is tokenized and the end ids follow."""
        committed = self._commit(is_final=True)
        self.is_ended = True
        return committed

    def _commit(self, is_final: bool) -> int:
        if not self.held_text:
            return 0
        ids, self.held_text = self.split(self.held_text, is_final)
        self.ids.extend(ids)
        return len(ids)

    @property
    def num_available(self) -> int:
        """Ids that can be read now (no limit once the text has ended)."""
        return NO_LIMIT if self.is_ended else len(self.ids)

    @property
    def ready_through(self) -> int:
        """The first absolute position whose text id is not known yet."""
        return NO_LIMIT if self.is_ended else self.first_position + len(self.ids)

    def at(self, index: int) -> int:
        """The `index`th id positions read (text ids, end ids, then pad); KeyError when not known yet."""
        if index < len(self.ids):
            return self.ids[index]
        if not self.is_ended:
            raise KeyError(f"text id {index} has not arrived (the scheduler runs no position past the text)")
        past = index - len(self.ids)
        return self.end_ids[past] if past < len(self.end_ids) else self.pad_id

    def id_at_position(self, position: int) -> int | None:
        """The text id absolute `position` reads (None: a position before the streamed text)."""
        return None if position < self.first_position else self.at(position - self.first_position)


def split_whole(encode: Callable[[str], list[int]]) -> SplitText:
    """For tokenizers whose ids never merge across pieces (bytes): every piece is final at once."""
    return lambda text, is_final: (encode(text), "")


def _kind(ch: str) -> str:
    return "S" if ch.isspace() else "L" if ch.isalpha() else "N" if ch.isdigit() else "P"


def last_word_start(text: str) -> int:
    """Where the last pre-token of a Qwen2 / GPT-style byte-level BPE may begin, as far as `text` shows:
    the last break between a letter run, a digit, a punctuation run and the whitespace that opens the
    next word (" ?\\p{L}+", "\\p{N}", " ?[^\\s\\p{L}\\p{N}]+", "\\s+"). Ids never merge across it."""
    for i in range(len(text) - 1, 0, -1):
        before, here = _kind(text[i - 1]), _kind(text[i])
        if before != "S" and (here == "S" or here == "N" or before != here):
            return i
    return 0


def split_last_word(encode: Callable[[str], list[int]]) -> SplitText:
    """For merging (BPE) tokenizers: the text up to its last word is final (ids never merge across
    a pre-token break); the last word waits for the next piece (it may grow: "wor" + "ld")."""

    def split(text: str, is_final: bool) -> tuple[list[int], str]:
        if is_final:
            return encode(text), ""
        start = last_word_start(text)
        return (encode(text[:start]), text[start:]) if start else ([], text)

    return split

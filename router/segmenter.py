"""Cut incrementally arriving text into segments to synthesize: at sentence ends always, at clause
boundaries once a segment is long enough, at a space when it grows too long without one, and
whatever is buffered on an explicit flush or at the end. Pure Python; `IncrementalSession` uses it.
"""

from __future__ import annotations

import re

SENTENCE_END = re.compile(r"[.!?\u2026\u3002\uff01\uff1f]+[\"')\]\u201d\u2019]*(?=\s)")
CLAUSE_END = re.compile(r"(?:[,;:\u3001\uff0c\uff1b]|\s[-\u2013\u2014])(?=\s)")


class TextSegmenter:
    """Buffers text pieces; `push` / `flush` return the segments that became complete."""

    def __init__(self, min_clause_chars: int, max_segment_chars: int) -> None:
        self.min_clause_chars = min_clause_chars
        self.max_segment_chars = max_segment_chars
        self.buffer = ""

    def push(self, piece: str) -> list[str]:
        self.buffer += piece
        segments = []
        while (cut := self._cut_at()) is not None:
            segment, self.buffer = self.buffer[:cut], self.buffer[cut:]
            if segment.strip():
                segments.append(segment.strip())
        return segments

    def flush(self) -> list[str]:
        """Everything buffered, as one segment (none when only whitespace is left)."""
        segment, self.buffer = self.buffer.strip(), ""
        return [segment] if segment else []

    def _cut_at(self) -> int | None:
        """Where the first complete segment of the buffer ends (None: wait for more text). A
        boundary counts once the whitespace after it has arrived ("3.5" or "e.g" stay whole)."""
        sentence = SENTENCE_END.search(self.buffer)
        if sentence is not None and sentence.end() <= self.max_segment_chars:
            return sentence.end()
        for clause in CLAUSE_END.finditer(self.buffer):
            if self.min_clause_chars <= clause.end() <= self.max_segment_chars:
                return clause.end()
        if len(self.buffer) > self.max_segment_chars:
            space = self.buffer.rfind(" ", 0, self.max_segment_chars)
            return space if space > 0 else self.max_segment_chars
        return None

"""WebSocket client for incremental text (`voxray say --incremental`, `loadtest.incremental_bench`):
types text into `/v1/audio/speech/stream` word by word at a given pace, as an LLM writing its reply
would, and times each piece to the first audio of the segment that speaks it. `whole_text=True`
sends the same text in one message once the last word is typed (the agent that waits for the
whole reply), over the same path, for comparison.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect


@dataclass
class IncrementalResult:
    pcm16: bytes = b""
    sample_rate_hz: int = 0
    piece_sent_s: list[float] = field(default_factory=list)  # since the first piece
    pieces: list[str] = field(default_factory=list)
    segment_texts: list[str] = field(default_factory=list)
    segment_first_audio_s: list[float] = field(default_factory=list)  # since the first piece
    chunk_arrivals_s: list[float] = field(default_factory=list)  # since the first piece
    chunk_durations_s: list[float] = field(default_factory=list)
    error: dict | None = None
    close_code: int = 0

    @property
    def first_audio_s(self) -> float | None:
        """From the first text piece to the first audio."""
        return self.segment_first_audio_s[0] if self.segment_first_audio_s else None

    def piece_latencies_s(self) -> list[float | None]:
        """Per piece: from its send to the first audio of the segment that speaks it."""
        ends, total = [], 0
        for text in self.segment_texts:
            total += _num_visible(text)
            ends.append(total)
        out: list[float | None] = []
        seen = 0
        for piece, sent_s in zip(self.pieces, self.piece_sent_s, strict=True):
            seen += _num_visible(piece)
            segment = next((k for k, end in enumerate(ends) if seen <= end), None)
            has_audio = segment is not None and segment < len(self.segment_first_audio_s)
            out.append(self.segment_first_audio_s[segment] - sent_s if has_audio else None)
        return out


def _num_visible(text: str) -> int:
    return len(re.sub(r"\s", "", text))


def words(text: str) -> list[str]:
    """The text as pieces of one word each, its following space included (~ one LLM token)."""
    return re.findall(r"\S+\s*", text)


def type_text(
    url: str, text: str, config: dict, tokens_per_s: float, whole_text: bool = False, timeout_s: float = 300.0
) -> IncrementalResult:
    """Stream `text` into the WebSocket at `tokens_per_s` words a second; collect the audio."""
    result = IncrementalResult(pieces=words(text) if not whole_text else [text])
    with connect(url, open_timeout=timeout_s, max_size=None) as ws:
        ws.send(json.dumps(config))
        ready = json.loads(ws.recv(timeout=timeout_s))
        if ready.get("type") != "ready":
            result.error = ready
            return result
        result.sample_rate_hz = ready["sample_rate_hz"]
        start_s = time.perf_counter()
        sender = threading.Thread(target=_send_pieces, args=(ws, words(text), tokens_per_s, whole_text, result))
        sender.start()
        _receive(ws, result, start_s, timeout_s)
        sender.join()
        result.piece_sent_s = [s - start_s for s in result.piece_sent_s]
    return result


def _send_pieces(ws, pieces: list[str], tokens_per_s: float, whole_text: bool, result: IncrementalResult) -> None:
    """One piece every 1 / tokens_per_s seconds; whole-text sends them all at the last one's time."""
    start_s = time.perf_counter()
    try:
        for i, piece in enumerate(pieces):
            time.sleep(max(0.0, start_s + i / tokens_per_s - time.perf_counter()))
            if whole_text:
                continue
            result.piece_sent_s.append(time.perf_counter())
            ws.send(json.dumps({"text": piece}))
        if whole_text:
            result.piece_sent_s.append(start_s)  # the agent's first token: when the wait began
            ws.send(json.dumps({"text": "".join(pieces)}))
        ws.send(json.dumps({"end": True}))
    except ConnectionClosed:
        pass


def _receive(ws, result: IncrementalResult, start_s: float, timeout_s: float) -> None:
    try:
        while True:
            message = ws.recv(timeout=timeout_s)
            if isinstance(message, bytes):
                result.pcm16 += message
                continue
            meta = json.loads(message)
            if meta["type"] == "audio":
                result.chunk_arrivals_s.append(time.perf_counter() - start_s)
                result.chunk_durations_s.append(meta["duration_s"])
            if meta["type"] == "audio" and "text" in meta:
                result.segment_texts.append(meta["text"])
                result.segment_first_audio_s.append(result.chunk_arrivals_s[-1])
            elif meta["type"] == "error":
                result.error = meta
    except ConnectionClosed as closed:
        result.close_code = closed.rcvd.code if closed.rcvd else -1

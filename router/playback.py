"""Server-side playback model of one stream (DESIGN section 1): TTFA, per-chunk underrun, viability.

Playback starts when the first non-empty chunk leaves (t0). Chunk i is on time iff the audio
already sent before it covers `t_i - t0`; its underrun is the shortfall. The Router feeds it
one call per chunk and exports the results as metrics; an incremental-text stream uses
`TextPacedPlayback`, whose clock restarts when the client let it run dry waiting for text.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PlaybackTracker:
    start_s: float  # request received
    first_audio_s: float | None = None
    first_text_s: float | None = None  # speech in: request received -> its answer's first text sent (s)
    audio_sent_s: float = 0.0
    underruns_s: list[float] = field(default_factory=list)

    @property
    def ttfa_s(self) -> float | None:
        return None if self.first_audio_s is None else self.first_audio_s - self.start_s

    @property
    def is_viable(self) -> bool:
        return self.first_audio_s is not None and all(u == 0.0 for u in self.underruns_s)

    def on_chunk(self, now_s: float, duration_s: float) -> float | None:
        """Record one chunk leaving at `now_s`; returns its underrun (None for the first audio)."""
        if duration_s <= 0:
            return None
        if self.first_audio_s is None:
            self.first_audio_s = now_s
            self.audio_sent_s = duration_s
            return None
        underrun = max(0.0, (now_s - self.first_audio_s) - self.audio_sent_s)
        self.underruns_s.append(underrun)
        self.audio_sent_s += duration_s
        return underrun


@dataclass
class TextPacedPlayback:
    """Playback of an incremental-text stream, counted once for the whole stream: like
    `PlaybackTracker`, but when text arrives after the client has played all its audio, the next
    chunk starts a new playback period instead of counting as an underrun (the client's silence was
    its own: it sent no text). TTFA is the stream's first audio after it opened."""

    start_s: float
    first_audio_s: float | None = None
    audio_sent_s: float = 0.0
    underruns_s: list[float] = field(default_factory=list)
    period_start_s: float | None = None  # when the current playback period's first chunk left
    period_audio_s: float = 0.0
    is_restart_due: bool = False

    @property
    def ttfa_s(self) -> float | None:
        return None if self.first_audio_s is None else self.first_audio_s - self.start_s

    @property
    def is_viable(self) -> bool:
        return self.first_audio_s is not None and all(u == 0.0 for u in self.underruns_s)

    def on_text(self, now_s: float) -> None:
        if self.period_start_s is not None and now_s >= self.period_start_s + self.period_audio_s:
            self.is_restart_due = True

    def on_chunk(self, now_s: float, duration_s: float) -> float | None:
        """Record one chunk leaving at `now_s`; returns its underrun (None: it starts a period)."""
        if duration_s <= 0:
            return None
        self.audio_sent_s += duration_s
        if self.first_audio_s is None:
            self.first_audio_s = now_s
        if self.period_start_s is None or self.is_restart_due:
            self.period_start_s, self.period_audio_s, self.is_restart_due = now_s, duration_s, False
            return None
        underrun = max(0.0, (now_s - self.period_start_s) - self.period_audio_s)
        self.underruns_s.append(underrun)
        self.period_audio_s += duration_s
        return underrun

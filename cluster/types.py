"""Messages shared by the stages: sampling parameters, token chunks and audio chunks.

The LLM stage produces `TokenChunk`s, the detokenizer turns them into `AudioChunk`s; the router
and the in-process pipeline pass both around. Chunks are self-describing: they carry their
left/right context frames so a cold detokenizer produces the same audio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """Per-request sampling; validated so a bad value names its field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.6, ge=0.0, le=10.0, description="0 = greedy.")
    top_k: int = Field(0, ge=0, le=1_000_000, description="0 = off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    repetition_window: int = Field(0, ge=0, description="Last N tokens penalised; 0 = whole sequence.")
    max_tokens: int = Field(1200, ge=1, le=100_000)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    guidance_scale: float | None = Field(
        None, ge=0.0, le=100.0, description="Classifier-free guidance scale (model's own formula); None = off."
    )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class TokenChunk:
    """Frames [window_start, window_end) of one request; samples of the kept frames are emitted.

    `frames` holds every frame of the window (context included) as lists of K codes.
    """

    req_id: str
    seq: int
    frames: list[list[int]]
    window_start: int
    keep_start: int
    keep_end: int
    is_final: bool
    deadline_s: float | None = None  # wall-clock time the client's buffer runs dry; None = startup (ASAP)

    @property
    def num_frames(self) -> int:
        return len(self.frames)


@dataclass
class AudioChunk:
    """PCM16 mono audio for one chunk of one request."""

    req_id: str
    seq: int
    pcm16: bytes
    sample_rate_hz: int
    is_final: bool
    timings: dict[str, float] = field(default_factory=dict)
    detok_replica: str = ""  # set by the DetokStage deployment
    num_frames: int = 0  # codec frames the audio covers (0 = unknown)

    @property
    def num_samples(self) -> int:
        return len(self.pcm16) // 2

    @property
    def duration_s(self) -> float:
        return self.num_samples / self.sample_rate_hz

"""Delay patterns for parallel-heads SpeechLMs (Dia, MusicGen, Bagpiper / OpusLM style).

Codebook k of frame t is generated at step t + delays[k]; before its first frame a codebook
holds BOS, after its last frame PAD. `interleave` / `deinterleave` convert whole sequences;
`StreamingDeinterleaver` releases frame t as soon as every codebook of t is known.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DelayPattern:
    delays: tuple[int, ...]  # per codebook, >= 0
    bos_id: int
    pad_id: int

    def __post_init__(self) -> None:
        if not self.delays or min(self.delays) < 0:
            raise ValueError(f"delays must be a non-empty list of non-negative ints, got {self.delays}")

    @property
    def num_codebooks(self) -> int:
        return len(self.delays)

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    def step_value(self, frames: list[list[int]], step: int, k: int) -> int:
        """The id codebook k holds at `step` of the delayed layout of `frames`."""
        t = step - self.delays[k]
        if t < 0:
            return self.bos_id
        return frames[t][k] if t < len(frames) else self.pad_id

    def interleave(self, frames: list[list[int]]) -> list[list[int]]:
        """frames [T][K] -> delayed steps [T + max_delay][K] with BOS / PAD fill."""
        num_steps = len(frames) + self.max_delay
        return [[self.step_value(frames, s, k) for k in range(self.num_codebooks)] for s in range(num_steps)]

    def deinterleave(self, steps: list[list[int]]) -> list[list[int]]:
        """Delayed steps [S][K] -> the frames [S - max_delay][K] fully contained in them."""
        num_frames = max(0, len(steps) - self.max_delay)
        return [[steps[t + d][k] for k, d in enumerate(self.delays)] for t in range(num_frames)]

    def forced_id(self, step: int, k: int) -> int | None:
        """BOS while codebook k has not reached its first frame, else None (free to sample)."""
        return self.bos_id if step < self.delays[k] else None


@dataclass
class StreamingDeinterleaver:
    """Per request: push one delayed step of K ids at a time, get back the frames it completes."""

    pattern: DelayPattern
    num_steps: int = 0
    _pending: dict[int, list[int | None]] = field(default_factory=dict)

    def push(self, step_ids: list[int] | tuple[int, ...]) -> list[list[int]]:
        if len(step_ids) != self.pattern.num_codebooks:
            raise ValueError(f"expected {self.pattern.num_codebooks} ids per step, got {len(step_ids)}")
        step, self.num_steps = self.num_steps, self.num_steps + 1
        for k, delay in enumerate(self.pattern.delays):
            if step >= delay:
                frame = self._pending.setdefault(step - delay, [None] * self.pattern.num_codebooks)
                frame[k] = step_ids[k]
        return self._release()

    def _release(self) -> list[list[int]]:
        done = []
        while self._pending:
            first = min(self._pending)
            codes = self._pending[first]
            if any(code is None for code in codes):
                break
            done.append([int(code) for code in codes])  # type: ignore[arg-type]
            del self._pending[first]
        return done

    @property
    def num_frames_released(self) -> int:
        """Frames released so far: every frame t with t + max_delay < num_steps."""
        return max(0, self.num_steps - self.pattern.max_delay)

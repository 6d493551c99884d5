"""A replica's measured prefill pace: prompt positions per second from the steps that prefilled, and
the audio front end's (log-mel, when the replica computes it) and encoder's seconds per second of
audio (speech in).

The LLM engine records every step that prefilled, every clip's front end (`LLMEngine.add_job`) and
every encode (`LLMEngine.step`); the LLMStage
reports both figures in its load report (`router.admission.ReplicaLoad`), where admission charges a
new request's prompt work (`llm_stage.prompt_work`) at them. A prefill step's own cost is what it
took beyond a decode step (the steady step at report time), so the pace is of the positions alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

PACE_SAMPLES_KEPT = 20  # recent prefill steps (and encodes) the figures come from


@dataclass
class PrefillPace:
    """Recent prefill steps (positions, seconds), front ends and encodes (audio seconds, seconds)."""

    _prefills: deque = field(default_factory=lambda: deque(maxlen=PACE_SAMPLES_KEPT))
    _encodes: deque = field(default_factory=lambda: deque(maxlen=PACE_SAMPLES_KEPT))
    _front_ends: deque = field(default_factory=lambda: deque(maxlen=PACE_SAMPLES_KEPT))

    def record_prefill(self, num_positions: int, elapsed_s: float) -> None:
        """A step that prefilled `num_positions` prompt positions took `elapsed_s` (its encode left out)."""
        if num_positions > 0:
            self._prefills.append((num_positions, elapsed_s))

    def record_encode(self, audio_s: float, elapsed_s: float) -> None:
        """The audio encoder took `elapsed_s` over `audio_s` seconds of clips (one batched forward)."""
        if audio_s > 0:
            self._encodes.append((audio_s, elapsed_s))

    def record_front_end(self, audio_s: float, elapsed_s: float) -> None:
        """The front end took `elapsed_s` over a clip of `audio_s` seconds (its log-mel, on the replica)."""
        if audio_s > 0:
            self._front_ends.append((audio_s, elapsed_s))

    def tokens_per_s(self, decode_step_s: float) -> float:
        """Prompt positions prefilled per second beyond a decode step of `decode_step_s`, over the recent
        prefill steps (a ratio of sums: the long prompts weigh most); 0 = unknown (none recorded, or
        they all took no longer than a decode step: a prompt then costs its step, nothing more)."""
        prefills = tuple(self._prefills)  # one copy: the engine thread appends while a report reads
        positions = sum(n for n, _ in prefills)
        extra_s = sum(max(0.0, elapsed_s - decode_step_s) for _, elapsed_s in prefills)
        return positions / extra_s if extra_s > 0 else 0.0

    def encoder_s_per_audio_s(self) -> float:
        """The encoder's seconds per second of audio over the recent encodes; 0 = none measured."""
        return _per_audio_s(self._encodes)

    def front_end_s_per_audio_s(self) -> float:
        """The front end's seconds per second of audio over the recent clips; 0 = none measured."""
        return _per_audio_s(self._front_ends)


def _per_audio_s(samples: deque) -> float:
    """Seconds per second of audio over (audio seconds, seconds) samples, a ratio of sums; 0 = none."""
    taken = tuple(samples)  # one copy: the engine thread appends while a report reads
    audio_s = sum(a for a, _ in taken)
    return sum(s for _, s in taken) / audio_s if audio_s > 0 else 0.0

"""The prompt work a request brings, estimated from its Job before it reaches a replica.

Admission (`router.admission`) charges a request's prefill at the replica's measured pace
(`llm_stage.prefill_pace`): a speech-in request's audio becomes many prompt positions (25 s of audio
about 315 for Step-Audio 2) and its encoder runs first. The Router and the LLM replica both call
`prompt_work` with the family's adapter class (no weights, no tokenizer needed).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.messages import Job
from llm_stage.models.base import LMAdapter


@dataclass(frozen=True)
class PromptWork:
    """What one request asks of a replica before its first output: prompt positions to prefill, seconds
    of audio to encode (and of those, the seconds whose front end the replica runs: a streamed turn's
    log-mel came with it), and whether its first output is text (a text-only answer: no chunk, no detok)."""

    num_positions: int = 0
    audio_s: float = 0.0
    text_only: bool = False
    front_end_audio_s: float = 0.0


def prompt_work(lm: type[LMAdapter], job: Job) -> PromptWork:
    """`job`'s prompt work for a family whose LM adapter is `lm` (its positions per audio second)."""
    if not lm.takes_audio:
        return PromptWork(lm.estimate_prompt_positions(job), 0.0, job.text_only, 0.0)
    last_s = job.audio.duration_s if job.audio is not None else 0.0
    if job.audio_tokens is not None:  # a streamed turn tokenized as it came: nothing left to encode
        last_s = 0.0
    earlier_s = sum(turn.audio.duration_s for turn in job.history if turn.audio is not None)  # encoded again
    front_end_s = earlier_s + (last_s if job.audio_features is None else 0.0)  # a streamed turn's came with it
    return PromptWork(lm.estimate_prompt_positions(job), last_s + earlier_s, job.text_only, front_end_s)

"""The prompt work a request brings, estimated from its Job before it reaches a replica.

Admission (`router.admission`) charges a request's prefill at the replica's measured pace
(`llm_stage.prefill_pace`): a speech-in request's audio becomes many prompt positions (25 s of audio
about 315 for Step-Audio 2) and its encoder runs first. The Router and the LLM replica both call
`prompt_work` with the family's adapter class (no weights, no tokenizer needed).

A conversation's turns are keyed (`next_turn_key` on the replica, for the prompt it keeps after a turn:
`llm_stage.kept_prompts`; `earlier_turns_key` on the Router, for the next turn's history without the
last answer), so the Router ranks the replica that kept a conversation's last prompt with the prefill
it saves (`PromptWork.on_kept_prompt`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from core.messages import ChatTurn, Job
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
    # a conversation's next turn: its earlier turns' key, and their positions and audio (a replica that kept
    # the last turn's prompt prefills none of them: `on_kept_prompt`)
    earlier_key: str | None = None
    earlier_positions: int = 0
    earlier_audio_s: float = 0.0
    # the Router's estimate of a request whose voice prompt is the replica's default voice's (it names no voice,
    # or its family's voices are alike): the positions each of the replica's default voice positions adds to
    # this work (1; 2 for a guided request whose twin carries the voice too; 0: counted already). A replica
    # reports its own (`ReplicaLoad.default_voice_positions`) and `with_default_voice` adds them.
    default_voice_weight: int = 0

    def with_default_voice(self, positions: int) -> PromptWork:
        """This work with the replica's default voice prompt of `positions` counted (`default_voice_weight`)."""
        if not self.default_voice_weight:
            return self
        return dataclasses.replace(self, num_positions=self.num_positions + self.default_voice_weight * positions,
                                   default_voice_weight=0)  # fmt: skip

    def on_replica_keeping(self, kept_keys: Collection[str]) -> PromptWork:
        """This work on a replica keeping the prompts of conversations `kept_keys`: less the earlier turns
        when it kept their prompt (`on_kept_prompt`), else as it is."""
        return self.on_kept_prompt() if self.earlier_key is not None and self.earlier_key in kept_keys else self

    def on_kept_prompt(self) -> PromptWork:
        """The work left on a replica that kept the conversation's last prompt: its positions are in the
        cache, its clips' tokens at hand."""
        return dataclasses.replace(
            self, num_positions=max(0, self.num_positions - self.earlier_positions),
            audio_s=max(0.0, self.audio_s - self.earlier_audio_s),
            front_end_audio_s=max(0.0, self.front_end_audio_s - self.earlier_audio_s), earlier_key=None,
            earlier_positions=0, earlier_audio_s=0.0,
        )  # fmt: skip


def prompt_work(lm: type[LMAdapter], job: Job, voice_positions: int = 0,
                default_voice_here: bool = False) -> PromptWork:  # fmt: skip
    """`job`'s prompt work for a family whose LM adapter is `lm` (its positions per audio second), with
    `voice_positions` its voice's prompt adds (known on the replica: `LMAdapter.voice_prompt_positions`).
    A guided job (CFG) prefills its hidden twin's prompt beside its own (`LMAdapter.twin_prompt_positions`).
    `default_voice_here`: the job's voice prompt is the replica's default one, which the caller (the Router)
    does not know: each replica's is added where it is asked (`PromptWork.default_voice_weight`)."""
    own = lm.estimate_prompt_positions(job) + voice_positions
    weight = default_voice_weight(lm, job, own) if default_voice_here else 0
    if not lm.takes_audio:
        return PromptWork(guided_positions(lm, job, own), 0.0, job.text_only, 0.0, default_voice_weight=weight)
    last_s = job.audio.duration_s if job.audio is not None else 0.0
    if job.audio_tokens is not None:  # a streamed turn tokenized as it came: nothing left to encode
        last_s = 0.0
    earlier_s = sum(turn.audio.duration_s for turn in job.history if turn.audio is not None)  # encoded again
    front_end_s = earlier_s + (last_s if job.audio_features is None else 0.0)  # a streamed turn's came with it
    work = PromptWork(guided_positions(lm, job, own), last_s + earlier_s, job.text_only, front_end_s,
                      default_voice_weight=weight)  # fmt: skip
    earlier_key = earlier_turns_key(job) if lm.reuses_prompt_kv else None
    if earlier_key is None:
        return work
    last_user = job.history[-2]  # the last turn's prompt: the turns before it, then its user turn
    last_job = dataclasses.replace(job, history=job.history[:-2], text=last_user.text, audio=last_user.audio,
                                   audio_features=None, audio_tokens=None)  # fmt: skip
    last_audio_s = sum(turn.audio.duration_s for turn in job.history[:-1] if turn.audio is not None)
    return dataclasses.replace(work, earlier_key=earlier_key, earlier_positions=lm.estimate_prompt_positions(last_job),
                               earlier_audio_s=last_audio_s)  # fmt: skip


def default_voice_weight(lm: type[LMAdapter], job: Job, positions: int) -> int:
    """The positions each position of a voice prompt adds to a job whose own prompt has `positions` without it:
    1, or 2 where a guided job's twin carries the voice too (Chatterbox's, as long as its own prompt)."""
    return guided_positions(lm, job, positions + 1) - guided_positions(lm, job, positions)


def guided_positions(lm: type[LMAdapter], job: Job, positions: int) -> int:
    """`positions` of a job's own prompt, plus its CFG twin's where the job is guided (the engine queues a
    twin for every job with a `guidance_scale`, and prefills both: `llm_stage.scheduler.unit_prefill_sizes`)."""
    if job.sampling.guidance_scale is None:
        return positions
    return positions + lm.twin_prompt_positions(positions)


def turns_key(system: str, turns: Sequence[ChatTurn]) -> str:
    """A conversation's key so far: its system turn and its turns' roles, text and audio."""
    digest = hashlib.blake2b(system.encode(), digest_size=12)
    for turn in turns:
        digest.update(f"\x00{turn.role}\x00{turn.text}\x00".encode())
        if turn.audio is not None:
            digest.update(f"{turn.audio.sample_rate_hz}\x00".encode() + turn.audio.pcm16)
    return digest.hexdigest()


def next_turn_key(job: Job) -> str:
    """The key the next turn's history starts with (less the answer to this one): this job's turns."""
    return turns_key(job.system, [*job.history, ChatTurn("user", job.text, job.audio)])


def earlier_turns_key(job: Job) -> str | None:
    """The key of the last turn this job's history answers (its history less the last answer); None: no
    earlier turn, or the history does not end with an answer."""
    if len(job.history) < 2 or job.history[-1].role != "assistant" or job.history[-2].role != "user":
        return None
    return turns_key(job.system, job.history[:-1])

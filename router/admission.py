"""Admission and TTFA prediction (pure functions over replica stats).

The LLMStage replica decides admit / queue / reject with `decide`; the request router ranks
replicas with `predict_ttfa_s`, and the Router rejects at once with `admits_anywhere`. All read
the `ReplicaLoad` the LLM replica publishes, which carries the detok stage's measured pace too
(router.detok_load). How many streams a replica takes comes from both stages' measured pace
(`stream_limit`), capped by its KV slots: a fixed count is either too cautious on a fast
machine or too bold on a slow one. How many may start at once is limited too (`startup_wait_s`):
a burst of streams started together underran however many the replica sustains. A request's own
prompt work (`llm_stage.prompt_work`: a speech-in clip's positions and encode) is charged at the
replica's measured prefill pace (`prefill_s`); a text-only answer's first output is its first text.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from llm_stage.prompt_work import PromptWork

DEFAULT_STEP_S = 0.02  # prior before the first measured step
# A stream is starting until it has sent this many chunks: before, its client holds one small
# first chunk, so the work of other streams starting beside it makes it underrun.
STARTUP_CHUNKS = 2
STARTS_KEPT = 20  # recent starts whose times a replica reports
STARTS_FRESH_S = 30.0  # starts older than this no longer count (a slow one from a passing burst)


class Admission(enum.Enum):
    ADMIT = "admit"
    QUEUE = "queue"
    REJECT = "reject"


@dataclass(frozen=True)
class ReplicaLoad:
    """What one LLM replica publishes through Serve's routing stats."""

    num_active: int  # requests in the engine (running + waiting for a slot)
    max_streams: int
    max_queued: int
    step_s: float  # EMA of one engine step
    first_chunk_tokens: int  # tokens before the first chunk can be decoded
    avg_stream_s: float  # EMA of a stream's lifetime in the engine; 0 = unknown
    real_time_streams: float = 0.0  # streams its largest measured batch keeps at real time; 0 = unknown
    measured_streams: int = 0  # streams in that batch
    real_time_margin: float = 0.85  # share of `real_time_streams` admitted (AdmissionConfig)
    num_starving: int = 0  # streams whose client buffer is spent right now
    # when the replica made this report: every report differs, so a router resets the requests it
    # counted as routed / completed since the last one even when an idle replica's load is unchanged
    reported_unix_s: float = 0.0
    next_step_s: float = 0.0  # its step measured at the batch one more stream makes; 0 = use step_s
    # the detok stage as this replica last saw it (router.detok_load.DetokSummary); 0 = not measured
    detok_real_time_streams: float = 0.0  # streams all detok replicas keep at real time
    detok_other_streams: int = 0  # streams other LLM replicas run through the detok stage
    detok_first_chunk_s: float = 0.0  # decode time of a new stream's first chunk
    predicts: bool = True  # False: admission.policy fixed_cap (streams counted against max_streams only)
    num_starting: int = 0  # streams running that have not sent STARTUP_CHUNKS chunks yet
    startup_limit: int = 0  # streams that may be starting at once (0 = no limit)
    startup_s: float = 0.0  # recent time from a stream's start to its STARTUP_CHUNKS-th chunk (p90); 0 = unknown
    measured_first_chunk_s: float = 0.0  # recent time from a stream's start to its first chunk (p90); 0 = unknown
    # recent time from a stream's arrival here (a wait in the queue included) to its first chunk (p90); 0 = unknown
    measured_ttfa_s: float = 0.0
    credible_ttfa_factor: float = 3.0  # a prediction past this many measured_ttfa_s refuses nothing (AdmissionConfig)
    # the most each running stream has left (s from the report), soonest first; () = unknown
    ends_in_s: tuple[float, ...] = ()
    # how long each starting stream has been starting (s at the report), longest first; () = none or unknown
    starting_for_s: tuple[float, ...] = ()
    # its measured prefill pace (llm_stage.prefill_pace); 0 = not measured, so nothing is charged for it
    prefill_tokens_per_s: float = 0.0  # prompt positions prefilled per second beyond a decode step
    encoder_s_per_audio_s: float = 0.0  # the audio encoder's seconds per second of audio (speech in)
    front_end_s_per_audio_s: float = 0.0  # its audio front end's (log-mel of a whole clip, on the replica)
    prefill_token_budget: int = 0  # prompt positions one step prefills at most (0 = unknown: a prompt, one step)
    # prompt positions already waiting to prefill there (new prompts and startups part-way through): a
    # request starting now is prefilled after them (`queued_prefill_s`)
    queued_prefill_positions: int = 0
    # conversations whose last prompt's KV it keeps (`llm_stage.kept_prompts`): their next turn prefills less
    kept_prompt_keys: tuple[str, ...] = ()
    # prompt positions its default voice adds to a request (`LMAdapter.voice_prompt_positions(None)`: the default
    # clip's transcript and speech tokens, Chatterbox's voice rows), which the Router's estimate cannot know
    default_voice_positions: int = 0

    def work_here(self, work: PromptWork | None) -> PromptWork | None:
        """`work` as this replica would do it: its default voice's prompt counted where the Router left it to
        the replica (`PromptWork.default_voice_weight`), less the earlier turns when it kept their prompt."""
        if work is None:
            return None
        return work.with_default_voice(self.default_voice_positions).on_replica_keeping(self.kept_prompt_keys)

    def to_stats(self) -> dict:
        return asdict(self)

    @classmethod
    def from_stats(cls, stats: dict) -> ReplicaLoad | None:
        try:
            return cls(**{k: stats[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError):
            return None


@dataclass
class StartTimes:
    """How long a replica's recent streams took from their start to their first chunk and to their
    STARTUP_CHUNKS-th, and from their arrival (a wait in the queue included) to their first chunk:
    the 90th percentile of the last STARTS_KEPT within STARTS_FRESH_S (0 when none). A queued
    stream is promised a start from these; promised from the mean, some were refused after their
    wait instead of at once. The replica records new streams only: a resumed or moved-in stream's
    first chunk (a long re-prefill, or none) says nothing of what a new one waits."""

    clock: Callable[[], float] = time.monotonic
    _first_chunk: deque = field(default_factory=lambda: deque(maxlen=STARTS_KEPT))  # (when, seconds)
    _started: deque = field(default_factory=lambda: deque(maxlen=STARTS_KEPT))
    _ttfa: deque = field(default_factory=lambda: deque(maxlen=STARTS_KEPT))

    def record(self, num_chunks: int, since_start_s: float, since_arrival_s: float | None = None) -> None:
        """A stream sent its `num_chunks`-th chunk `since_start_s` after it started (and
        `since_arrival_s` after it arrived; None: as it started)."""
        if num_chunks == 1:
            self._first_chunk.append((self.clock(), since_start_s))
            self._ttfa.append((self.clock(), since_start_s if since_arrival_s is None else since_arrival_s))
        if num_chunks == STARTUP_CHUNKS:
            self._started.append((self.clock(), since_start_s))

    def first_chunk_s(self) -> float:
        return self._p90(self._first_chunk)

    def startup_s(self) -> float:
        return self._p90(self._started)

    def ttfa_s(self) -> float:
        return self._p90(self._ttfa)

    def _p90(self, samples: deque) -> float:
        since_s = self.clock() - STARTS_FRESH_S
        fresh = sorted(seconds for when, seconds in samples if when >= since_s)
        return fresh[math.ceil(0.9 * len(fresh)) - 1] if fresh else 0.0


def _paced(margin: float, real_time: float, measured: int) -> int:
    """One past the largest measured batch (`measured`) while that batch keeps real time with the
    margin to spare (a probe: the larger batch is measured next, so the limit grows with what is
    measured); else the margin under what it keeps at real time (it shrinks when steps slow)."""
    spare = margin * real_time
    return measured + 1 if spare >= measured else math.floor(spare)


def detok_stream_limit(load: ReplicaLoad) -> int | None:
    """Streams this replica may run through the detok stage: the margin under what the stage keeps
    at real time, less what the other LLM replicas run there (None: not measured). That figure
    comes from the stage's decode cost per audio second with its batches as they met, which more
    streams only lower, so it needs no probe (a probe by chunks per decode step held the stage
    near its largest batch of chunks: streams' chunks seldom meet in one step). A CFG twin sends
    no chunks, so the detok stage counts streams, not rows."""
    if load.detok_real_time_streams <= 0:
        return None
    return math.floor(load.real_time_margin * load.detok_real_time_streams) - load.detok_other_streams


def stream_limit(load: ReplicaLoad) -> int:
    """Streams the replica runs at once: its KV cap, and once its pace is measured, one stream past
    its largest measured batch while that batch keeps real time with the margin to spare (a probe:
    its step is measured next, so the limit grows as larger batches are measured), else the margin
    under what that batch keeps at real time (it shrinks when steps slow down); and the same margin
    under what the detok stage keeps at real time. (`admission.policy: fixed_cap`: the KV cap only.)"""
    if not load.predicts:
        return load.max_streams
    paced = load.max_streams
    if load.real_time_streams > 0:
        paced = _paced(load.real_time_margin, load.real_time_streams, load.measured_streams)
    paced = _under_caps(load, paced)
    if load.num_starving:  # a stream is already behind: nothing new starts until it catches up
        paced = min(paced, load.num_active)
    return max(1, paced)


def _under_caps(load: ReplicaLoad, streams: int) -> int:
    """`streams`, no more than the detok stage's limit (`detok_stream_limit`) and the KV cap."""
    detok = detok_stream_limit(load)
    return min(load.max_streams, streams if detok is None else min(streams, detok))


def prefill_s(load: ReplicaLoad, work: PromptWork | None) -> float:
    """A request's own prompt work (`work`; None: none known) at the replica's measured pace: its audio
    through the front end (when the replica runs it) and the encoder, its prompt positions beyond the
    steps that prefill them, and those steps past the first (every prediction counts one): a prompt
    longer than `prefill_token_budget` is prefilled over several steps. A pace not measured charges
    nothing (for positions: the steps alone): nothing is refused on a figure nothing measured."""
    if work is None:
        return 0.0
    audio_s = work.front_end_audio_s * load.front_end_s_per_audio_s + work.audio_s * load.encoder_s_per_audio_s
    positions_s = work.num_positions / load.prefill_tokens_per_s if load.prefill_tokens_per_s > 0 else 0.0
    more_steps = math.ceil(work.num_positions / load.prefill_token_budget) - 1 if load.prefill_token_budget else 0
    return audio_s + positions_s + max(0, more_steps) * (load.next_step_s or load.step_s or DEFAULT_STEP_S)


def queued_prefill_s(load: ReplicaLoad) -> float:
    """How long the prompts already waiting to prefill on the replica hold back one starting now (it is
    prefilled after them, first come first served): their positions at the measured pace, and the whole
    steps the prefill budget spreads them over. Unmeasured pace or budget: that part charges nothing."""
    positions = load.queued_prefill_positions
    positions_s = positions / load.prefill_tokens_per_s if load.prefill_tokens_per_s > 0 else 0.0
    steps = positions // load.prefill_token_budget if load.prefill_token_budget else 0
    return positions_s + steps * (load.next_step_s or load.step_s or DEFAULT_STEP_S)


def first_chunk_s(load: ReplicaLoad, work: PromptWork | None = None) -> float:
    """Predicted time from a stream's start to its first output: the step that prefills its prompt and
    its own prompt work (`prefill_s`), then its first chunk's tokens at the step measured for the batch
    it joins and that chunk's decode at the detok stage. A text-only answer's first output is its first
    text, which the prefill's step samples: no chunk's steps, no decode."""
    step_s = load.next_step_s or load.step_s or DEFAULT_STEP_S
    if work is not None and work.text_only:
        return step_s + prefill_s(load, work)
    return (load.first_chunk_tokens + 1) * step_s + load.detok_first_chunk_s + prefill_s(load, work)


def start_to_first_output_s(load: ReplicaLoad, work: PromptWork | None = None) -> float:
    """What a request held in the queue takes from its start to its first output, as the replica holding
    it reckons its start-by: the prediction (`first_chunk_s`), and no less than recent streams took to
    their first chunk (`measured_first_chunk_s`), save for a text-only answer (those were chunks)."""
    predicted_s = first_chunk_s(load, work)
    if work is not None and work.text_only:
        return predicted_s
    return max(predicted_s, load.measured_first_chunk_s)


def limits_startups(load: ReplicaLoad) -> bool:
    return load.predicts and load.startup_limit > 0


def starting_allowed(load: ReplicaLoad) -> int:
    """Streams that may be starting at once on this replica now: `startup_limit`, and no more than
    half the stream limit's room past the streams playing steadily (at least one). A starting stream
    fills its client's buffer ahead of playback, at about twice a playing stream's pace, so it
    weighs two: the more streams play, the fewer start together, down to one at a time. (Two or
    three streams starting within 0.3 s beside six playing underran, though under the startup
    limit.) With none playing, starts meet only each other: the startup limit alone. The room is
    counted under what the measured pace sustains, not under a limit still probing it (at 6 where
    the pace sustained 9, two streams starting beside two playing refused a third)."""
    steady = load.num_active - load.num_starting
    if steady <= 0:  # none playing: starts only meet each other, which the startup limit bounds
        return load.startup_limit
    room = (max(stream_limit(load), _sustained_streams(load)) - steady) // 2
    return max(1, min(load.startup_limit, room))


def _sustained_streams(load: ReplicaLoad) -> int:
    """The margin under the streams both stages' measured pace keeps at real time, under the KV cap
    (0: not measured). Unlike `stream_limit` no probe: a limit one past the largest batch measured
    so far says what is measured, not what the replica sustains."""
    if load.real_time_streams <= 0:
        return 0
    return _under_caps(load, math.floor(load.real_time_margin * load.real_time_streams))


def startup_wait_s(load: ReplicaLoad, extra_requests: int = 0) -> float:
    """How long one more request waits for the streams starting now before it may start itself:
    past the streams allowed to start at once (`starting_allowed`), a wave of starts (`startup_s`)
    per that many ahead of it; the first wave less what the start it waits for has run already
    (`starting_for_s`: counted from none run, a stream with 1 playing and 2 starting for a while
    was refused at a predicted 1.16 s). Streams that start together each hold one small chunk
    while the others' first chunks take the steps: started beyond that limit (a burst), they all
    underran."""
    if not limits_startups(load):
        return 0.0
    allowed = starting_allowed(load)
    position = load.num_starting + extra_requests - allowed  # >= 0: waits for a start to end
    if position < 0:
        return 0.0
    # a start's own cost is the floor: a queued stream promised less (no start measured yet, or
    # recent starts that met no burst) was refused after its wait instead of at once
    wave_s = max(load.startup_s, STARTUP_CHUNKS * first_chunk_s(load))
    if position < len(load.starting_for_s):  # the starts running now: the one started longest ago ends first
        return max(0.0, wave_s - load.starting_for_s[position])
    return (position // allowed + 1) * wave_s


def predict_ttfa_s(load: ReplicaLoad, extra_requests: int = 0, work: PromptWork | None = None) -> float:
    """Predicted time to first output (audio; a text-only answer's first text) for one more request on
    this replica: its prefill with its own prompt work `work` at the measured pace, its first chunk's
    tokens at the step measured for the batch it joins, that chunk's decode at the detok stage
    (`first_chunk_s`) behind the prompts waiting to prefill there (`queued_prefill_s`), and, past the
    stream limit, the wait for running streams to end, or past the startup limit, the wait for the
    streams starting now (the longer). One that waits takes at least
    what recent streams took to their first chunk (`start_to_first_output_s`), as the replica holding
    it reckons its start-by: queued on the prediction alone, a burst's streams were refused after
    0.7 s of waiting (recent starts under load took longer than the steps measured alone)."""
    step_s = load.next_step_s or load.step_s or DEFAULT_STEP_S
    generate_s = first_chunk_s(load, work)
    limit = stream_limit(load)
    position = load.num_active + extra_requests - limit  # >= 0: waits for a running stream to end
    slot_wait_s = 0.0
    if position >= 0:
        slot_wait_s = _slot_wait_s(load, position, limit, step_s)
    wait_s = max(slot_wait_s, startup_wait_s(load, extra_requests))
    if wait_s > 0:  # then it starts as recent streams did: the replica holding it refuses it by that
        generate_s = start_to_first_output_s(load, work)
    else:  # it starts now, behind the prompts waiting there
        generate_s += queued_prefill_s(load)
    return generate_s + wait_s


def _slot_wait_s(load: ReplicaLoad, position: int, limit: int, step_s: float) -> float:
    """How long a request `position` places past the stream limit waits for a slot: until the
    `position + 1`-th running stream ends at the latest (`ends_in_s`), else (not known) a share of
    a stream's mean lifetime per place. (From the mean alone, streams started together by a burst
    looked as if they ended one after another: a stream queued on that was refused after its wait.)"""
    if position < len(load.ends_in_s):
        return load.ends_in_s[position]
    by_mean_s = (position + 1) * (load.avg_stream_s or load.first_chunk_tokens * 10 * step_s) / max(1, limit)
    return max([by_mean_s, *load.ends_in_s[-1:]])


def has_room(load: ReplicaLoad) -> bool:
    """Whether one more stream may start now: under the stream limit, and under the startup limit."""
    starting_full = limits_startups(load) and load.num_starting >= starting_allowed(load)
    return load.num_active < stream_limit(load) and not starting_full


def is_credible(load: ReplicaLoad, predicted_s: float, work: PromptWork | None = None) -> bool:
    """Whether a predicted time to first audio may refuse a request for its deadline: at most
    `credible_ttfa_factor` times what the replica's recent new streams measured (`measured_ttfa_s`,
    their queue waits included), or nothing measured to hold it to. A prediction far beyond that runs
    on a transient (a survivor's steps right after a failover, the first steps of a replacement):
    after an LLM replica was killed, the survivor refused requests on a predicted 39.5 s while the
    one sent 0.3 s later met its first audio in 2.2 s. Nor may a prediction that rests on no measured
    step (the DEFAULT_STEP_S prior: the report was taken before the replica's first step): a fresh
    replica refused a lone client's second request on the prior's 0.72 s, while its first had met
    its first audio in 0.09 s. The request's own prompt work at the measured pace (`prefill_s` of
    `work`) and the prompts waiting there (`queued_prefill_s`) are added to the bound: a long clip's
    prefill is no transient, and the recent streams' TTFA need not have carried one."""
    if not (load.next_step_s or load.step_s):
        return False
    if load.measured_ttfa_s <= 0 or load.credible_ttfa_factor <= 0:
        return True
    bound_s = load.credible_ttfa_factor * load.measured_ttfa_s + prefill_s(load, work) + queued_prefill_s(load)
    return predicted_s <= bound_s


def credible_ttfa_s(load: ReplicaLoad, work: PromptWork | None = None) -> float | None:
    """`predict_ttfa_s` of a request bringing `work` (as this replica would do it: `work_here`) when
    credible (`is_credible`), else None (not known)."""
    work = load.work_here(work)
    predicted_s = predict_ttfa_s(load, work=work)
    return predicted_s if is_credible(load, predicted_s, work) else None


def decide(load: ReplicaLoad, deadline_s: float, work: PromptWork | None = None) -> Admission:
    """Reject when the predicted first output of a request bringing `work` (its own prompt work:
    `predict_ttfa_s`) misses `deadline_s` (a credible prediction: `is_credible`; past it the request
    is admitted or queued as if it met it, and the replica holding it refuses it only once it could
    no longer start in time); otherwise admit under the stream and startup limits, and queue past
    them while the queue has room (the prediction counts the wait). An idle replica admits: only a
    running stream measures its steps again, so a slow figure (a cold first decode, a burst of load
    beside it) would otherwise reject everything for good. (`work` as this replica would do it: `work_here`.)"""
    work = load.work_here(work)
    if load.num_active == 0:
        return Admission.ADMIT
    if load.predicts:
        predicted_s = predict_ttfa_s(load, work=work)
        if predicted_s > deadline_s and is_credible(load, predicted_s, work):
            return Admission.REJECT
    if has_room(load):
        return Admission.ADMIT
    return Admission.QUEUE if load.num_active - stream_limit(load) < load.max_queued else Admission.REJECT


def admits_anywhere(loads: list[ReplicaLoad], deadline_s: float, work: PromptWork | None = None) -> bool:
    """Whether some LLM replica would admit, or queue in time, a request with this TTFA deadline that
    brings `work` (the Router's reject-at-once check over its load board; [] = unknown, so yes)."""
    return not loads or any(decide(load, deadline_s, work) is not Admission.REJECT for load in loads)

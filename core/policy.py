"""The scheduling policy (pure Python): one object per engine, made by `make_policy` from the
SchedulerConfig, that the LLM scheduler, the detokenizer's batcher, the chunk schedule and
throughput mode all ask.

`fcfs` decodes in arrival order; `throughput` is FCFS with long chunks and no deadlines;
`streaming` orders rows by playback deadline: streams close to an underrun (urgent) go first,
earliest deadline first (oldest first when more streams play than the batch sustains); then
startup-phase requests (no audio sent yet, including new ones still to prefill), FCFS, at most
`startup_concurrency` of them and only as many as the batch can keep at real time next to the
streams already playing; then the rest by slack (those with slack to sit out a frame's steps as
`can_wait`, which the scheduler fills in the batch's output-head phase first); startups past
either limit last. Slack = audio buffered at the client - time to produce and ship the smallest
next chunk (adaptive chunks shrink to the buffer, so that is how long a stream can be left out
of the batch). A stream is urgent when its slack is shorter than the time the startups now
queued would hold the batch, a long prompt's chunked-prefill steps counted (`urgent_horizon_s`):
a startup thus takes rows only from streams that can afford to wait for it, and only when the
engine can carry one more stream: near capacity, giving rows to startups made every stream
underrun. The playback clock (first audio,
audio sent) is kept on each row by whoever ships the audio.

Head-phase alignment (`HeadPhases`) is part of the policy too: for models whose output head
cycles through phases (Orpheus' seven frame-slot heads), rows in one phase share one head matmul,
so starts and fill rows are timed to the phase most rows are in.
"""

from __future__ import annotations

import enum
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.config import SchedulerConfig
from core.messages import TokenChunk

MIN_URGENT_SLACK_S = 0.03  # a stream with less slack is urgent even with no startup queued: steps jitter
MAX_URGENT_SLACK_S = 0.3  # and one with more never is: the fixed threshold this horizon replaced
STARTUP_COVER = 4.0  # urgency horizon / time the queued startups' first chunks hold the batch
CAPACITY_MARGIN = 0.9  # share of the estimated sustainable streams startups may fill: steps jitter
MIN_STEP_SAMPLES = 3  # steps at a batch size before it counts as measured: one slow step is noise
STEP_SAMPLES_KEPT = 9  # recent steps per batch size whose median is that size's step time
STEP_FRESH_S = 15.0  # a batch size not stepped this long stops counting while others are measured


class StreamRow(Protocol):
    """What the policy reads of a scheduled request (the LLM stage's `Request` is one)."""

    arrival_s: float
    first_audio_s: float | None
    audio_sent_s: float
    tokens_to_next_chunk: int
    is_twin: bool
    num_cached: int
    prompt_len: int
    num_prompt_left: int  # known positions still to prefill
    output_ids: list

    @property
    def unit(self) -> Sequence[Any]: ...


class PolicyKind(enum.Enum):
    FCFS = "fcfs"
    STREAMING = "streaming"
    THROUGHPUT = "throughput"


@dataclass(frozen=True)
class DecodePriority:
    """A policy's batch order for one step: `ahead` decode first, then up to `new_requests` new
    requests get prefill rows, then `rest` fill what is left, then `can_wait`, then `last` (then
    more prefills, as rows allow). `can_wait` holds rows that lose nothing by waiting a few
    steps: the scheduler reorders them to keep the batch in one output-head phase; the other
    lists keep the policy's order."""

    ahead: list
    new_requests: int = 0
    rest: list = field(default_factory=list)
    can_wait: list = field(default_factory=list)
    last: list = field(default_factory=list)


# (decoding rows, requests still to prefill their prompt) -> rows in order, or a DecodePriority
DecodeOrder = Callable[[list, Sequence], "list | DecodePriority"]


def fcfs_order(requests: list, to_prefill: Sequence = ()) -> list:
    """Arrival order; FCFS ignores the requests still to prefill."""
    return sorted(requests, key=lambda r: r.arrival_s)


def _ema(last: float | None, value: float) -> float:
    """Exponential moving average with weight 0.1 on the new value; the first value as is."""
    return value if last is None else 0.9 * last + 0.1 * value


@dataclass
class StepSamples:
    """Recent step times per batch size. A size's step is the median of its last
    STEP_SAMPLES_KEPT steps, and a size counts as measured only after MIN_STEP_SAMPLES: a single
    slow step (a garbage collection, a neighbour's burst on a shared CPU) taken as a batch's speed
    held a replica at one stream. And only sizes stepped within STEP_FRESH_S count while any
    did: a batch measured slow in a passing burst is never run again once the limit drops under
    it, so its old figure held the limit down for good (all sizes count when none is fresh: an
    idle replica keeps what it last knew)."""

    clock: Callable[[], float] = time.monotonic
    _recent: dict[int, deque] = field(default_factory=dict)
    _median: dict[int, float] = field(default_factory=dict)  # sizes measured, kept current at each record
    _last_s: dict[int, float] = field(default_factory=dict)  # when each size last stepped

    def record(self, size: int, elapsed_s: float) -> None:
        recent = self._recent.setdefault(size, deque(maxlen=STEP_SAMPLES_KEPT))
        recent.append(elapsed_s)
        self._last_s[size] = self.clock()
        if len(recent) >= MIN_STEP_SAMPLES:
            self._median[size] = statistics.median(recent)

    def measured(self) -> dict[int, float]:
        """{batch size: its step time} for the sizes measured (a copy): the fresh ones if any."""
        since_s = self.clock() - STEP_FRESH_S
        fresh = {size: step_s for size, step_s in self._median.items() if self._last_s[size] >= since_s}
        return fresh or dict(self._median)


@dataclass
class StepTimer:
    """What the policy knows of the engine's pace: EMAs of the step (overall and per batch size)
    and of one detokenizer chunk, and the audio one frame plays (learned from shipped chunks)."""

    step_s: float = 0.02
    detok_s: float = 0.05
    steps_per_frame: float = 1.0  # engine steps per codec frame (`LMAdapter.steps_per_frame`)
    frame_s: float | None = None  # audio seconds per frame; None until a chunk with frames is shipped
    steps_by_rows: StepSamples = field(default_factory=StepSamples)
    _seen: bool = False
    _decode_step_s: float | None = None  # EMA of decode-only steps

    def record_step(self, elapsed_s: float, rows: int = 0) -> None:
        """A step of `rows` decode rows (0: it prefilled too)."""
        self.step_s = _ema(self.step_s if self._seen else None, elapsed_s)
        self._seen = True
        if rows > 0:
            self.steps_by_rows.record(rows, elapsed_s)
            self._decode_step_s = _ema(self._decode_step_s, elapsed_s)

    @property
    def steady_step_s(self) -> float:
        """The step as streams decoding meet it: the EMA of decode-only steps (`step_s` before one).
        Admission predicts from it: a resumed stream's prefill (its prompt and every token it had
        sent) took seconds on a survivor, and `step_s` carried it into every prediction after."""
        return self.step_s if self._decode_step_s is None else self._decode_step_s

    @property
    def measured_step_s(self) -> float:
        """`steady_step_s` once a step was measured, else 0.0 (the figure is the prior): what a load
        report carries, so that admission knows a prediction from it rests on no measurement."""
        return self.steady_step_s if self._seen else 0.0

    @property
    def step_s_by_rows(self) -> dict[int, float]:
        """Decode-only step time per batch size measured (`StepSamples`)."""
        return self.steps_by_rows.measured()

    def record_detok(self, elapsed_s: float) -> None:
        self.detok_s = _ema(self.detok_s, elapsed_s)

    def record_audio(self, duration_s: float, frames: int) -> None:
        if frames > 0 and duration_s > 0:
            self.frame_s = duration_s / frames

    def measured_real_time_rows(self) -> float | None:
        """Rows the largest decode batch measured so far keeps at real time: that batch's rows x
        their speed (None until a decode-only step and a frame's duration are known). Unlike
        `sustainable_streams` it never assumes a larger batch steps as fast as a measured one."""
        step_s_by_rows = self.step_s_by_rows
        if self.frame_s is None or not step_s_by_rows:
            return None
        rows = max(step_s_by_rows)
        return rows * self.frame_s / (self.steps_per_frame * step_s_by_rows[rows])

    def sustainable_streams(self, max_rows: int) -> float | None:
        """Rows (single-row streams) a full batch keeps at real time: rows x per-row speed at the
        largest decode batch measured up to `max_rows` (None until a decode-only step and a
        frame's duration are known)."""
        step_s_by_rows = self.step_s_by_rows
        sizes = [rows for rows in step_s_by_rows if rows <= max_rows]
        if self.frame_s is None or not sizes:
            return None
        step_s = step_s_by_rows[max(sizes)]
        return max_rows * self.frame_s / (self.steps_per_frame * step_s)


def buffered_s(req: StreamRow, now_s: float) -> float:
    """Audio at the client not yet played (playback starts with the first chunk)."""
    if req.first_audio_s is None:
        return 0.0
    return req.first_audio_s + req.audio_sent_s - now_s


def slack_s(req: StreamRow, now_s: float, timer: StepTimer) -> float:
    produce_s = req.tokens_to_next_chunk * timer.step_s + timer.detok_s
    return buffered_s(req, now_s) - produce_s


class StreamingOrder:
    """A DecodeOrder: urgent (EDF) > startups, bounded, FCFS (decoding, then new requests'
    prefills) > the rest by slack (`rest`: tight; `can_wait`: slack past the horizon by a frame's
    steps, which the scheduler may reorder by head phase) > startups past the limits (`last`).

    Urgent = slack under `urgent_horizon_s`, which grows with the startups queued (decoding ones,
    and requests still to prefill: waiting for a slot or a row, or part-way through a chunked
    prefill, each for the steps its prompt takes at `prefill_token_budget` positions a step): a
    stream yields its row to startups only while its buffer outlasts their first chunks with a
    margin. The horizon scales with the engine's step time, so a faster engine gives startups rows
    sooner; a fixed threshold kept every stream at that much slack however fast the engine ran.

    With `max_batch_size` set, startups go ahead only while streams in playback + startups stay
    within CAPACITY_MARGIN of what a full batch sustains (`StepTimer.sustainable_streams`); past
    that they wait for rows like FCFS requests do, instead of starting a stream the engine
    cannot keep. And when more streams are playing than the batch sustains (the step slowed, or
    streams outnumber rows), urgent streams go by arrival instead of deadline: EDF would spread
    the unavoidable misses over all of them, seniority keeps them on the newest.
    """

    def __init__(
        self,
        startup_concurrency: int,
        timer: StepTimer,
        clock: Callable[[], float] = time.monotonic,
        max_batch_size: int | None = None,
        prefill_token_budget: int | None = None,
    ):
        self.startup_concurrency = startup_concurrency
        self.timer = timer
        self.clock = clock
        self.max_batch_size = max_batch_size
        self.prefill_token_budget = prefill_token_budget  # prompt positions a step prefills (None: a prompt, one step)
        self.capacity_margin = CAPACITY_MARGIN

    def __call__(self, requests: list, to_prefill: Sequence = ()) -> DecodePriority:
        now = self.clock()
        startup = fcfs_order([r for r in requests if r.first_audio_s is None])
        steady = [r for r in requests if r.first_audio_s is not None]
        slack = {id(r): slack_s(r, now, self.timer) for r in steady}
        playing_rows = sum(len(r.unit) for r in steady)
        sustained = self.sustained_streams()
        horizon = self.urgent_horizon_s(startup, to_prefill)
        urgent = [r for r in steady if slack[id(r)] < horizon]
        if sustained is not None and playing_rows > math.floor(sustained):  # overload: some must miss
            urgent = fcfs_order(urgent)  # seniority puts the misses on the fewest, newest streams
        else:
            urgent.sort(key=lambda r: buffered_s(r, now))  # earliest deadline first
        comfortable = sorted((r for r in steady if slack[id(r)] >= horizon), key=lambda r: slack[id(r)])
        ample = horizon + self.timer.steps_per_frame * self.timer.step_s  # slack to sit out a frame's steps
        tight = [r for r in comfortable if slack[id(r)] < ample]
        ahead = self.startups_ahead(playing_rows, sustained)
        first, deferred = startup[:ahead], startup[ahead:]
        return DecodePriority(urgent + first, ahead - len(first), tight, comfortable[len(tight) :], deferred)

    def urgent_horizon_s(self, startups: list, to_prefill: Sequence = ()) -> float:
        """Slack below which a stream keeps its row ahead of startups: STARTUP_COVER x the time the
        startups' first chunks (decoding ones, and each request still `to_prefill`, whose prompt holds
        a row for `prefill_steps` more) fill the batch, plus one detokenizer call, within
        [MIN_URGENT_SLACK_S, MAX_URGENT_SLACK_S]. The cap keeps a burst of queued startups from
        making every stream urgent, which left the startups waiting longest. (A long spoken prompt,
        ~315 positions per 25 s of Step-Audio 2 audio, holds a row for several steps: counted as one,
        streams gave their rows up with too little buffer to outlast it.)"""
        tokens = sum(max(1, r.tokens_to_next_chunk) for r in startups)
        tokens += sum(max(1, r.tokens_to_next_chunk) + self.prefill_steps(r) for r in to_prefill)
        rows = self.max_batch_size or max(1, self.startup_concurrency)
        fill_s = tokens / rows * self.timer.step_s
        return min(MAX_URGENT_SLACK_S, max(MIN_URGENT_SLACK_S, STARTUP_COVER * fill_s + self.timer.detok_s))

    def prefill_steps(self, req: StreamRow) -> int:
        """Steps `req`'s unit still takes to prefill its prompt: its rows' positions left over the
        per-step budget, at least one (one when no budget is known)."""
        if not self.prefill_token_budget:
            return 1
        positions = sum(row.num_prompt_left for row in req.unit)
        return max(1, math.ceil(positions / self.prefill_token_budget))

    def sustained_streams(self) -> float | None:
        """Single-row streams a full batch keeps at real time (None: unknown, or no batch cap given)."""
        return None if self.max_batch_size is None else self.timer.sustainable_streams(self.max_batch_size)

    def startups_ahead(self, playing_rows: int, sustained: float | None) -> int:
        """Startups (running or new) that may go ahead of streams in playback (whose units hold
        `playing_rows` rows: a guided request and its twin are two)."""
        if sustained is None:
            return self.startup_concurrency
        return max(0, min(self.startup_concurrency, math.floor(self.capacity_margin * sustained) - playing_rows))


class HeadPhases:
    """Output-head phase alignment for models whose head cycles through `period` phases.

    A request's prompt is completed (its first token sampled) only in a step where that token's
    phase is the one most decoding rows are in, so streams that start apart decode in lockstep; a
    start waits at most `period` - 1 steps. Rows the order marks `can_wait` fill the batch in its
    phase first; a row left out while the batch decodes moves one phase closer, so a stream out
    of phase rejoins within `period` - 1 steps. Period 1 (no head cycle) changes nothing.
    """

    def __init__(self, period: int = 1) -> None:
        self.period = period
        self._held_steps = 0  # consecutive steps a start waited for its phase
        self._held_this_step = False
        self._start_phases: frozenset[int] | None = None  # phases a first token may take this step (None: any)

    def begin_step(self, decoding: list) -> None:
        """Work out, once per schedule, the phases a prompt-completing request's first token may
        take: the most common among the tokens the decoding rows sample next; any without a head
        cycle, with nothing decoding, or after `period` - 1 held steps."""
        self._held_this_step = False
        self._start_phases = None
        if self.period == 1 or self._held_steps >= self.period - 1 or not decoding:
            return
        phases = Counter(self.next_phase(r) for r in decoding)
        most = max(phases.values())
        self._start_phases = frozenset(phase for phase, count in phases.items() if count == most)

    def may_start(self, req: StreamRow) -> bool:
        """Whether `req` may sample its first token this step (else the start is held)."""
        if self._start_phases is None or self.first_phase(req) in self._start_phases:
            return True
        self._held_this_step = True
        return False

    def end_step(self) -> None:
        self._held_steps = self._held_steps + 1 if self._held_this_step else 0

    def in_phase_first(self, fill: list, chosen: list, free_rows: int) -> list:
        """`fill` with the rows in the batch's head phase first (stable: the policy's order within
        each group), when not all of `fill` fits in `free_rows`."""
        if self.period == 1 or sum(len(r.unit) for r in fill) <= free_rows:
            return fill
        phases = Counter(self.next_phase(r) for r in (chosen or fill) if not r.is_twin)
        if not phases:
            return fill
        target = phases.most_common(1)[0][0]
        return sorted(fill, key=lambda r: self.next_phase(r) != target)

    def next_phase(self, req: StreamRow) -> int:
        """Head phase of the token a decoding row samples next (next sampled index mod the period),
        whether or not the last sampled token is appended yet."""
        return (req.num_cached - req.prompt_len + 1) % self.period

    def first_phase(self, req: StreamRow) -> int:
        """Head phase of the token `req` samples when its prompt completes."""
        return len(req.output_ids) % self.period


class SchedulingPolicy:
    """The policy every part of one engine asks: the LLM scheduler (`decode_priority`, `phases`),
    the detokenizer's batcher (`chunk_priority`), the chunk schedule and throughput mode
    (`uses_long_chunks`, `honours_deadlines`). Made by `make_policy`; tests may pass their own
    order."""

    def __init__(self, kind: PolicyKind, order: DecodeOrder = fcfs_order, head_phase_period: int = 1) -> None:
        self.kind = kind
        self.order = order
        self.phases = HeadPhases(head_phase_period)

    @property
    def honours_deadlines(self) -> bool:
        """Whether playback deadlines order the work (`streaming`)."""
        return self.kind is PolicyKind.STREAMING

    @property
    def uses_long_chunks(self) -> bool:
        """Throughput mode: no deadlines, so every chunk is long (fewer context frames decoded twice)."""
        return self.kind is PolicyKind.THROUGHPUT

    def decode_priority(self, decoding: list, to_prefill: Sequence = ()) -> DecodePriority:
        """This step's decode order (`to_prefill`: the requests still to prefill their prompt); a plain
        order means: all decodes, then prefills."""
        priority = self.order(decoding, to_prefill)
        return priority if isinstance(priority, DecodePriority) else DecodePriority(priority)

    def chunk_priority(self, chunk: TokenChunk, submitted_s: float) -> tuple:
        """Sort key of a chunk queued at the detokenizer: FIFO, or when deadlines count, startup
        chunks (no deadline) first in submission order, then by playback deadline (EDF)."""
        if not self.honours_deadlines:
            return (submitted_s,)
        return (0, submitted_s) if chunk.deadline_s is None else (1, chunk.deadline_s, submitted_s)


def make_policy(
    config: SchedulerConfig,
    timer: StepTimer | None = None,
    head_phase_period: int = 1,
    clock: Callable[[], float] = time.monotonic,
) -> SchedulingPolicy:
    """The policy `config.policy` names. `timer` is the engine's pace (the streaming order reads
    it); `head_phase_period` is the model's head cycle, used when `config.align_starts`."""
    kind = PolicyKind(config.policy)
    order: DecodeOrder = fcfs_order
    if kind is PolicyKind.STREAMING:
        timer = timer or StepTimer()
        order = StreamingOrder(
            config.startup_concurrency, timer, clock, config.max_batch_size, config.prefill_token_budget
        )
    return SchedulingPolicy(kind, order, head_phase_period if config.align_starts else 1)

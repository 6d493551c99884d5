"""Streaming-aware batch policy (pure Python), used by the LLM scheduler and the detokenizer.

Streams close to an underrun (urgent) go first, earliest playback deadline first (oldest
first when more streams play than the batch sustains); then startup-phase requests (no audio
sent yet, including new ones still to prefill), FCFS, at most `startup_concurrency` of them and
only as many as the batch can keep at real time next to the streams already playing; then the
rest by slack (those with slack to sit out a frame's steps as `can_wait`, which the scheduler
fills in the batch's output-head phase first); startups past either limit last. Slack = audio
buffered at the client - time to produce and ship the smallest next chunk (adaptive chunks
shrink to the buffer, so that is how long a stream can be left out of the batch). A stream is
urgent when its slack is shorter than the time the startups now queued would hold the batch
(`urgent_horizon_s`): a startup thus takes rows only from streams that can afford to wait for
it, and only when the engine can carry one more stream: near capacity, giving rows to startups
made every stream underrun (BENCHMARKS "Urgent streams keep their rows", "Admission by
capacity"). The playback clock (first audio, audio sent) is kept on each Request by whoever
ships the audio.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cluster.config import SchedulerConfig
from llm_stage.request import Request
from llm_stage.scheduler import DecodeOrder, DecodePriority, fcfs_order

MIN_URGENT_SLACK_S = 0.03  # a stream with less slack is urgent even with no startup queued: steps jitter
MAX_URGENT_SLACK_S = 0.3  # and one with more never is: the fixed threshold this horizon replaced
STARTUP_COVER = 4.0  # urgency horizon / time the queued startups' first chunks hold the batch
CAPACITY_MARGIN = 0.9  # share of the estimated sustainable streams startups may fill: steps jitter


def _ema(last: float | None, value: float) -> float:
    """Exponential moving average with weight 0.1 on the new value; the first value as is."""
    return value if last is None else 0.9 * last + 0.1 * value


@dataclass
class StepTimer:
    """What the policy knows of the engine's pace: EMAs of the step (overall and per batch size)
    and of one detokenizer chunk, and the audio one frame plays (learned from shipped chunks)."""

    step_s: float = 0.02
    detok_s: float = 0.05
    tokens_per_frame: int = 1
    frame_s: float | None = None  # audio seconds per frame; None until a chunk with frames is shipped
    step_s_by_rows: dict[int, float] = field(default_factory=dict)
    _seen: bool = False

    def record_step(self, elapsed_s: float, rows: int = 0) -> None:
        self.step_s = _ema(self.step_s if self._seen else None, elapsed_s)
        self._seen = True
        if rows > 0:
            self.step_s_by_rows[rows] = _ema(self.step_s_by_rows.get(rows), elapsed_s)

    def record_detok(self, elapsed_s: float) -> None:
        self.detok_s = _ema(self.detok_s, elapsed_s)

    def record_audio(self, duration_s: float, frames: int) -> None:
        if frames > 0 and duration_s > 0:
            self.frame_s = duration_s / frames

    def sustainable_streams(self, max_rows: int) -> float | None:
        """Rows (single-row streams) a full batch keeps at real time: rows x per-row speed at the
        largest decode batch measured up to `max_rows` (None until a decode-only step and a
        frame's duration are known)."""
        sizes = [rows for rows in self.step_s_by_rows if rows <= max_rows]
        if self.frame_s is None or not sizes:
            return None
        step_s = self.step_s_by_rows[max(sizes)]
        return max_rows * self.frame_s / (self.tokens_per_frame * step_s)


def buffered_s(req: Request, now_s: float) -> float:
    """Audio at the client not yet played (playback starts with the first chunk)."""
    if req.first_audio_s is None:
        return 0.0
    return req.first_audio_s + req.audio_sent_s - now_s


def slack_s(req: Request, now_s: float, timer: StepTimer) -> float:
    produce_s = req.tokens_to_next_chunk * timer.step_s + timer.detok_s
    return buffered_s(req, now_s) - produce_s


class StreamingOrder:
    """A DecodeOrder: urgent (EDF) > startups, bounded, FCFS (decoding, then new requests'
    prefills) > the rest by slack (`rest`: tight; `can_wait`: slack past the horizon by a frame's
    steps, which the scheduler may reorder by head phase, BENCHMARKS "Phase-aligned fill") >
    startups past the limits (`last`).

    Urgent = slack under `urgent_horizon_s`, which grows with the startups queued (decoding ones
    and, through `bind_queue`, new requests still waiting for a slot or a row): a stream yields
    its row to startups only while its buffer outlasts their first chunks with a margin. A fixed
    0.3 s threshold kept every stream at 0.3 s of slack however fast the engine ran: at 2 ms
    steps that is 150 steps in which startups could have had its row (BENCHMARKS "A 5x faster
    box").

    With `max_batch_size` set, startups go ahead only while streams in playback + startups stay
    within CAPACITY_MARGIN of what a full batch sustains (`StepTimer.sustainable_streams`); past
    that they wait for rows like FCFS requests do, instead of starting a stream the engine
    cannot keep. And when more streams are playing than the batch sustains (the step slowed, or
    streams outnumber rows), urgent streams go by arrival instead of deadline: EDF would spread
    the unavoidable misses over all of them, seniority keeps them on the newest (BENCHMARKS
    "Seniority under overload").
    """

    def __init__(
        self,
        startup_concurrency: int,
        timer: StepTimer,
        clock: Callable[[], float] = time.monotonic,
        max_batch_size: int | None = None,
    ):
        self.startup_concurrency = startup_concurrency
        self.timer = timer
        self.clock = clock
        self.max_batch_size = max_batch_size
        self.capacity_margin = CAPACITY_MARGIN
        self.queued: Callable[[], Sequence[Request]] = tuple  # new requests not yet admitted

    def bind_queue(self, queued: Callable[[], Sequence[Request]]) -> None:
        """Let the policy see the requests waiting for admission (the scheduler calls this)."""
        self.queued = queued

    def __call__(self, requests: list[Request]) -> DecodePriority:
        now = self.clock()
        startup = fcfs_order([r for r in requests if r.first_audio_s is None])
        steady = [r for r in requests if r.first_audio_s is not None]
        slack = {id(r): slack_s(r, now, self.timer) for r in steady}
        playing_rows = sum(len(r.unit) for r in steady)
        sustained = self.sustained_streams()
        horizon = self.urgent_horizon_s(startup)
        urgent = [r for r in steady if slack[id(r)] < horizon]
        if sustained is not None and playing_rows > math.floor(sustained):  # overload: some must miss
            urgent = fcfs_order(urgent)  # seniority puts the misses on the fewest, newest streams
        else:
            urgent.sort(key=lambda r: buffered_s(r, now))  # earliest deadline first
        comfortable = sorted((r for r in steady if slack[id(r)] >= horizon), key=lambda r: slack[id(r)])
        ample = horizon + self.timer.tokens_per_frame * self.timer.step_s  # slack to sit out a frame's steps
        tight = [r for r in comfortable if slack[id(r)] < ample]
        ahead = self.startups_ahead(playing_rows, sustained)
        first, deferred = startup[:ahead], startup[ahead:]
        return DecodePriority(urgent + first, ahead - len(first), tight, comfortable[len(tight) :], deferred)

    def urgent_horizon_s(self, startups: list[Request]) -> float:
        """Slack below which a stream keeps its row ahead of startups: STARTUP_COVER x the time the
        queued startups' first chunks (plus a prefill step for each new request) fill the batch,
        plus one detokenizer call, within [MIN_URGENT_SLACK_S, MAX_URGENT_SLACK_S]. Uncapped, a
        burst of queued startups made every stream urgent and the startups waited longer than
        with the fixed threshold (BENCHMARKS "A 5x faster box")."""
        tokens = sum(max(1, r.tokens_to_next_chunk) for r in startups)
        tokens += sum(max(1, r.tokens_to_next_chunk) + 1 for r in self.queued())
        rows = self.max_batch_size or max(1, self.startup_concurrency)
        fill_s = tokens / rows * self.timer.step_s
        return min(MAX_URGENT_SLACK_S, max(MIN_URGENT_SLACK_S, STARTUP_COVER * fill_s + self.timer.detok_s))

    def sustained_streams(self) -> float | None:
        """Single-row streams a full batch keeps at real time (None: unknown, or no batch cap given)."""
        return None if self.max_batch_size is None else self.timer.sustainable_streams(self.max_batch_size)

    def startups_ahead(self, playing_rows: int, sustained: float | None) -> int:
        """Startups (running or new) that may go ahead of streams in playback (whose units hold
        `playing_rows` rows: a guided request and its twin are two)."""
        if sustained is None:
            return self.startup_concurrency
        return max(0, min(self.startup_concurrency, math.floor(self.capacity_margin * sustained) - playing_rows))


def make_decode_order(
    config: SchedulerConfig, timer: StepTimer, clock: Callable[[], float] = time.monotonic
) -> DecodeOrder:
    """FCFS for `fcfs` and `throughput` (which ignores deadlines), StreamingOrder for `streaming`."""
    if config.policy == "streaming":
        return StreamingOrder(config.startup_concurrency, timer, clock, max_batch_size=config.max_batch_size)
    return fcfs_order

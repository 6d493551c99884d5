"""Discrete-event model of one VoxRay cluster: Poisson streams through LLM replicas, then detok replicas.

Coarser than `loadtest/policy_sim.py`, on purpose. policy_sim drives the real `Scheduler`, policy and
`LLMSide` on a fake clock for one replica: exact to the row, ~0.3 s per 48 requests. Here each LLM replica
is a batch server priced per step from a calibration table (rows x tokens cached; where the calibration
measured the steps' spread, each step x a factor of its slow or fast spell and one of its own: admission's
median sits under the mean, and slow spells drain buffers, as on a real replica); every admitted stream
decodes one token every step (FCFS-like: no stream is skipped for its slack; the scheduler's
`startup_concurrency` only orders rows while `max_batch_size` >= the slots, as in every shipped config),
new streams' prompts join the step they are admitted in. All replicas step in lockstep over numpy arrays
[replicas, slots] (each keeps its own clock), so 10,000 concurrent streams cost seconds. The detokenizer
stage runs after, as a second pass over the chunks' cut times (the LLM does not wait for it, as in
serving): each detok replica batches what has arrived (FIFO, at most `max_batch_chunks`) and costs by the
frames in the batch.
Admission: a stream waits FCFS at its replica (the router picks the one with the fewest open streams) for
one of `max_streams_per_replica` slots, under the stream and start limits the replica's own measured steps
give (`paced_admission`: starts go in waves of `max_starting_per_replica`, fewer beside playing streams; none
while a stream is behind), and is refused after `admission_wait_s`. Metrics follow DESIGN §1.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from cluster.planner.calibration import Calibration, StepSpread
from cluster.planner.paced_admission import MeasuredSteps, starting_allowed, stream_limit, sustained_streams
from cluster.planner.shared_cores import CoreShare
from cluster.planner.workload import ChunkRule, ModelRates, Streams
from router.admission import STARTUP_CHUNKS

SPREAD_SEED_STREAM = 1  # the step spread's draws: seeded by (SimOptions.seed, this), not the arrivals' stream


class StepDraws:
    """Each replica's step factors from the calibration's `StepSpread`: a spell's factor, drawn again each
    time its clock crosses a multiple of `spell_s`, times a step's own."""

    def __init__(self, spread: StepSpread, replicas: int, seed: int) -> None:
        self.spread = spread
        self.spells, self.steps = np.asarray(spread.spells), np.asarray(spread.steps)
        self.rng = np.random.default_rng((seed, SPREAD_SEED_STREAM))  # apart from the arrivals' draws
        self.spell = np.full(replicas, -1, np.int64)  # the spell each replica's factor was drawn for
        self.spell_factor = np.ones(replicas)

    def factors(self, clock: np.ndarray) -> np.ndarray:
        """The factor of each replica's step beginning at `clock`."""
        spell = np.floor(clock / self.spread.spell_s).astype(np.int64)
        new = spell != self.spell
        if new.any():
            self.spell_factor[new] = self.spells[self.rng.integers(len(self.spells), size=int(new.sum()))]
            self.spell[new] = spell[new]
        return self.spell_factor * self.steps[self.rng.integers(len(self.steps), size=len(clock))]


@dataclass(frozen=True)
class ClusterShape:
    llm_replicas: int
    detok_replicas: int  # 0: unlimited (every chunk decoded alone, on arrival)
    max_streams_per_replica: int
    # admission.max_starting_per_replica: streams one replica starts at once (0: no limit). A stream is
    # starting until its STARTUP_CHUNKS-th chunk is delivered; with streams playing, fewer (`starting_allowed`)
    max_starting_per_replica: int = 0
    # admission.policy predictive: a replica runs and starts streams under what its own measured steps keep
    # at real time (`paced_admission`); False: the slots alone (fixed_cap), the start room under the slots
    paced: bool = True


@dataclass(frozen=True)
class SimOptions:
    seed: int = 0
    admission_wait_s: float = 2.0  # a stream still waiting for a slot after this is refused
    step_scale: float = 1.0  # x every LLM step: what-if for a slower / faster device
    detok_scale: float = 1.0
    min_measured: int = 100  # the measurement window lasts until this many streams arrived in it
    # > 0: each draw is a load test's (`workload.make_streams`): this many seconds of arrivals from an empty
    # cluster, all measured, no tail; 0: the steady window (warm-up, `min_measured` arrivals, a tail)
    draw_s: float = 0.0
    # LLM passes: the first takes each chunk's delivery as the hops and one detok step, each later one the
    # delivery the pass before measured (a slot and a start are held until audio is delivered) and, with
    # shared cores, the other stage's busy time; 0: 2, or 3 with shared cores (the stages' contention settles)
    passes: int = 0
    # Poisson draws per load that must mostly meet the SLO (`search.meets_slo`): one draw of ~100 streams
    # swings the p90 TTFA by 5x near capacity (cpu-1x1-cap4 at 1.71 req/s: 0.33-1.68 s over 8 seeds)
    seeds: int = 1
    trace_admission: bool = False  # keep each step's admission limits (`LLMPass.admission`; `loadtest.plan_trace`)
    # each LLM step's cost x factors drawn from the calibration's `llm.step_spread` (where it has one: spells
    # and steps, `StepDraws`): the mean step is the table's; False: every step the mean
    step_spread: bool = True

    def passes_for(self, shared_cores: bool) -> int:
        return self.passes or (3 if shared_cores else 2)


@dataclass(frozen=True)
class LLMPass:
    chunk_stream: np.ndarray  # [C] the stream each cut chunk belongs to
    chunk_seq: np.ndarray  # [C]
    chunk_cut_s: np.ndarray  # [C]
    chunk_kept: np.ndarray  # [C] frames the chunk keeps (plays)
    chunk_window: np.ndarray  # [C] frames the detokenizer decodes for it
    admitted_s: np.ndarray  # [N], nan if never admitted
    llm_load: float  # time-average of step / real-time step (>= 1: the rows fall behind playback)
    slot_use: float  # time-average of open streams / slots
    llm_busy: np.ndarray | None = None  # LLM processes busy per `CoreShare` bin (None: cores not shared)
    admission: AdmissionTrace | None = None  # with `SimOptions.trace_admission`


@dataclass(frozen=True)
class AdmissionTrace:
    """Every step of a simulated LLM pass, per replica [steps, R]: when it began and lasted, the stream limit
    admission gave the replica, its open streams, and whether a waiting stream was held back by the limits
    (what `loadtest.loop_stalls` samples from a real replica's load)."""

    clock_s: np.ndarray
    step_s: np.ndarray
    limit: np.ndarray
    num_open: np.ndarray
    held: np.ndarray  # bool
    measured_rows: np.ndarray  # the largest measured batch admission paced by (0: none yet)
    real_time: np.ndarray  # the streams that batch's median step keeps at real time (0: none measured)
    starts_full: np.ndarray  # bool: as many streams starting as `starting_allowed` (`loop_stalls`' "starts full")

    def summary(self, window_s: tuple[float, float]) -> dict[str, float]:
        """Time-weighted over the steps begun in `window_s`: the mean limit and open streams a replica, the
        share of the time its open streams filled the limit (`loop_stalls`' "full"), and the share a stream
        waited that the limits held back."""
        weight = np.where((self.clock_s >= window_s[0]) & (self.clock_s < window_s[1]), self.step_s, 0.0)
        total = max(float(weight.sum()), 1e-12)
        return {name: float((values * weight).sum() / total)
                for name, values in (("mean_limit", self.limit), ("mean_open", self.num_open),
                                     ("full_share", self.num_open >= self.limit),
                                     ("held_share", self.held), ("mean_measured_rows", self.measured_rows),
                                     ("mean_real_time_streams", self.real_time),
                                     ("starts_full_share", self.starts_full))}  # fmt: skip


@dataclass(frozen=True)
class Prediction:
    p50_ttfa_s: float
    p90_ttfa_s: float
    viable_pct: float
    rejected_pct: float
    worst_underrun_s: float
    queue_wait_p90_s: float
    llm_load: float
    detok_load: float
    slot_use: float
    num_measured: int

    @property
    def bottleneck(self) -> str:
        """The most loaded of the three: LLM step time, detokenizer busy time, admission slots."""
        loads = {"llm step": self.llm_load, "detok": self.detok_load, "admission": self.slot_use}
        return max(loads, key=loads.__getitem__)

    def meets(self, ttfa_p90_s: float, min_viable_pct: float) -> bool:
        return self.p90_ttfa_s <= ttfa_p90_s and self.viable_pct >= min_viable_pct


@dataclass
class _Replicas:
    """State of every LLM replica's slots, [replicas, slots]."""

    stream: np.ndarray
    generated: np.ndarray
    tokens: np.ndarray
    frames: np.ndarray
    seq: np.ndarray
    emitted: np.ndarray  # frames covered by the chunks cut so far
    cache: np.ndarray
    prompt: np.ndarray
    first_cut_s: np.ndarray  # float, nan until chunk 0 is cut
    starting_until_s: np.ndarray  # float: the stream counts as starting until then (inf until chunk 1 is cut)
    held_until_s: np.ndarray  # float: a finished stream's slot is held until its last audio is delivered

    def __post_init__(self) -> None:
        assert all(array.flags.c_contiguous for array in vars(self).values()), "_flat views need C order"

    @classmethod
    def empty(cls, replicas: int, slots: int) -> _Replicas:
        def zeros() -> np.ndarray:
            return np.zeros((replicas, slots), np.int64)

        def full(value: float) -> np.ndarray:
            return np.full((replicas, slots), value)

        return cls(np.full((replicas, slots), -1), zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros(),
                   full(np.nan), full(np.inf), full(-np.inf))  # fmt: skip

    def free(self, clock: np.ndarray, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """The free slots of the replicas `rows` ([len(rows), S]; `clock` is every replica's)."""
        return (self.stream[rows] < 0) & (self.held_until_s[rows] <= clock[rows, None])

    def open_streams(self, clock: np.ndarray, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Per replica (of `rows`), the streams admission counts: generating, or finished with audio still on its
        way."""
        return (~self.free(clock, rows)).sum(axis=1)


@dataclass
class _Queues:
    """Each replica's routed streams in arrival order, padded with -1 / inf."""

    ids: np.ndarray  # [R, Q]
    arrival_s: np.ndarray  # [R, Q]
    length: np.ndarray  # [R]
    head: np.ndarray  # [R]

    def head_arrival(self) -> np.ndarray:
        col = np.minimum(self.head, self.ids.shape[1] - 1)
        return np.where(self.head < self.length, self.arrival_s[np.arange(len(self.head)), col], np.inf)


def _flat(array: np.ndarray) -> np.ndarray:
    """`array` [replicas, slots] as one row of slots: a view (`_Replicas` keeps C-contiguous arrays, updated
    in place), so writes through it reach the state."""
    return array.ravel()


def _picked(mask: np.ndarray) -> np.ndarray | slice:
    """The replicas `mask` picks: every one as a slice (a view, no gather: a few replicas all asked), else
    their indices."""
    return slice(None) if mask.all() else np.flatnonzero(mask)


def route_streams(streams: Streams, replicas: int, rates: ModelRates) -> np.ndarray:
    """The router's pick per stream: the replica with the fewest streams expected open at its arrival
    (a stream is taken to stay open for its audio's length)."""
    ends: list[tuple[float, int]] = []
    open_count = [0] * replicas
    choice = np.empty(streams.count, np.int64)
    hold_s = streams.frames * rates.frame_s
    for sid in range(streams.count):
        now = streams.arrival_s[sid]
        while ends and ends[0][0] <= now:
            open_count[heapq.heappop(ends)[1]] -= 1
        replica = open_count.index(min(open_count))
        open_count[replica] += 1
        heapq.heappush(ends, (now + hold_s[sid], replica))
        choice[sid] = replica
    return choice


def _queues(streams: Streams, choice: np.ndarray, replicas: int) -> _Queues:
    counts = np.bincount(choice, minlength=replicas)
    width = max(1, int(counts.max()))
    ids = np.full((replicas, width), -1, np.int64)
    order = np.argsort(choice, kind="stable")  # stream ids by replica, arrival order kept
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    cols = np.arange(streams.count) - np.repeat(starts, counts)
    ids[choice[order], cols] = order
    arrival = np.where(ids >= 0, streams.arrival_s[np.maximum(ids, 0)], np.inf)
    return _Queues(ids, arrival, counts, np.zeros(replicas, np.int64))


def starving(state: _Replicas, clock: np.ndarray, rates: ModelRates,
             rows: np.ndarray | slice = slice(None)) -> np.ndarray:  # fmt: skip
    """Per replica (of `rows`), whether a generating stream's client buffer is spent
    (`LLMSide.num_starving`): it played since its first chunk's cut all the audio cut so far."""
    played_s = clock[rows, None] - state.first_cut_s[rows]  # nan before the first chunk: not starving
    with np.errstate(invalid="ignore"):
        behind = (state.stream[rows] >= 0) & (state.emitted[rows] * rates.frame_s - played_s <= 0)
    return behind.any(axis=1)


def _admit_room(state: _Replicas, shape: ClusterShape, steps: MeasuredSteps, clock: np.ndarray, rates: ModelRates,
                rows: np.ndarray | slice = slice(None)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Per replica of `rows`, (how many more streams may start now, the stream limit, whether the start limit
    is full): room under the stream limit and the start limit the router computes from the replica's measured
    steps (`paced_admission`; a large number: no limit). Only the replicas admission asks about are computed:
    in a fleet, a few of many have a stream waiting at a step."""
    slots = shape.max_streams_per_replica
    num_open = state.open_streams(clock, rows)
    if shape.paced:
        real_time, measured_rows = steps.real_time_streams(clock, rates.real_time_step_s, rows)
        limit = stream_limit(slots, real_time, measured_rows)
        # a stream already behind: nothing new starts until it catches up (`router.admission.stream_limit`)
        behind = starving(state, clock, rates, rows)
        limit = np.where(behind, np.maximum(1, np.minimum(limit, num_open)), limit)
        room_under = np.maximum(limit, sustained_streams(slots, real_time))
    else:
        limit = room_under = np.full(len(num_open), slots)
    room = limit - num_open
    if shape.max_starting_per_replica <= 0:
        return room, limit, np.zeros(len(room), bool)
    num_starting = ((state.stream[rows] >= 0) & (state.starting_until_s[rows] > clock[rows, None])).sum(axis=1)
    allowed = starting_allowed(num_open, num_starting, room_under, shape.max_starting_per_replica)
    return np.minimum(room, allowed - num_starting), limit, num_starting >= allowed


def _admit(state: _Replicas, queues: _Queues, clock: np.ndarray, streams: Streams, tokens_per_frame: float,
           wait_s: float, admitted_s: np.ndarray, start_room: np.ndarray) -> np.ndarray:  # fmt: skip
    """Fill free slots FCFS from each replica's queue while its limits have room (`start_room`);
    refuse heads that waited past `wait_s`. Returns the slots filled [R, S] (their prompts join this step)."""
    filled = np.zeros(state.stream.shape, bool)
    start_room = start_room.copy()
    while True:
        head_arrival = queues.head_arrival()
        waiting = head_arrival <= clock
        expired = waiting & (clock - head_arrival > wait_s)
        if expired.any():
            queues.head[expired] += 1  # refused: admitted_s stays nan
            continue
        free = state.free(clock)
        can = waiting & free.any(axis=1) & (start_room > 0)
        if not can.any():
            return filled
        r = np.flatnonzero(can)
        s = np.argmax(free[r], axis=1)
        sid = queues.ids[r, queues.head[r]]
        frames = streams.frames[sid]
        state.stream[r, s], state.generated[r, s], state.seq[r, s], state.emitted[r, s] = sid, 0, 0, 0
        state.frames[r, s], state.tokens[r, s] = frames, np.ceil(frames * tokens_per_frame)
        state.first_cut_s[r, s] = np.nan
        state.starting_until_s[r, s] = np.inf
        state.prompt[r, s] = state.cache[r, s] = streams.prompt_tokens[sid]
        admitted_s[sid] = clock[r]
        queues.head[r] += 1
        start_room[r] -= 1
        filled[r, s] = True


def _budget_frames(state: _Replicas, at: np.ndarray, clock: np.ndarray, step_s: np.ndarray, rates: ModelRates,
                   rule: ChunkRule, detok_step_s: float) -> np.ndarray:  # fmt: skip
    """For the slots at flat indices `at`, the frames its client's buffer can wait for (playback taken to
    start at the first cut)."""
    rows = at // state.stream.shape[1]
    played_s = clock[rows] - _flat(state.first_cut_s)[at]
    buffered_s = _flat(state.emitted)[at] * rates.frame_s - played_s
    frame_cost_s = np.maximum(step_s[rows] * rates.tokens_per_frame, 1e-6)
    budget = np.floor((rule.buffer_safety * buffered_s - detok_step_s) / frame_cost_s)
    return np.where(np.isnan(budget), rule.planned_size(_flat(state.seq)[at]), budget).astype(np.int64)


def _cut_chunks(state: _Replicas, rule: ChunkRule, clock: np.ndarray, step_s: np.ndarray, rates: ModelRates,
                detok_step_s: float, delivery_s: np.ndarray) -> list[np.ndarray]:  # fmt: skip
    """Cut every chunk whose kept frames and right context now exist (or the stream ended):
    [stream ids, seqs, cut times, kept frames, window frames], in slot order; advances the slots' seq and
    emitted. A stream stops starting when its STARTUP_CHUNKS-th chunk is delivered: cut, plus its
    `delivery_s`. Works on the flat indices of the slots still generating audio, and after each round on the
    ones it just cut (no other slot's readiness changes within a step): a fleet's [replicas, slots] is
    mostly idle or between cuts."""
    stream, seq, emitted, frames = (_flat(a) for a in (state.stream, state.seq, state.emitted, state.frames))
    at = np.flatnonzero((stream >= 0) & (emitted < frames))
    budget = _budget_frames(state, at, clock, step_s, rates, rule, detok_step_s)
    frames_done = np.minimum((_flat(state.generated)[at] // rates.tokens_per_frame).astype(np.int64), frames[at])
    parts: list[list[np.ndarray]] = [[], [], [], [], []]
    while True:
        start, total = emitted[at], frames[at]
        end = np.minimum(start + rule.next_size(seq[at], budget), total)
        ready_at = np.minimum(end + rule.right_context_frames, total)
        ready = (start < total) & (frames_done >= ready_at)
        if not ready.any():
            return [np.concatenate(p) if p else np.empty(0) for p in parts]
        at, budget, frames_done = at[ready], budget[ready], frames_done[ready]
        start, end, ready_at = start[ready], end[ready], ready_at[ready]
        rows, slot_seq = at // state.stream.shape[1], seq[at]
        window = ready_at - np.maximum(start - rule.left_context_frames, 0)
        for part, value in zip(parts, (stream[at], slot_seq, clock[rows], end - start, window), strict=True):
            part.append(value)
        first = at[slot_seq == 0]
        _flat(state.first_cut_s)[first] = clock[rows[slot_seq == 0]]
        started = slot_seq == STARTUP_CHUNKS - 1
        _flat(state.starting_until_s)[at[started]] = clock[rows[started]] + delivery_s[stream[at[started]]]
        seq[at] += 1
        emitted[at] = end


def _step_s(state: _Replicas, filled: np.ndarray, calib: Calibration, options: SimOptions) -> np.ndarray:
    """Each replica's next step: the table at its rows and mean tokens cached, plus new prompts."""
    live = state.stream >= 0
    rows = live.sum(axis=1)
    mean_cache = (state.cache * live).sum(axis=1) / np.maximum(rows, 1)
    step_ms = calib.llm_step.step_ms(rows, mean_cache) * calib.pipeline_step_factor
    prefill_ms = calib.prefill_ms_per_token * (state.prompt * filled).sum(axis=1)
    return (step_ms + prefill_ms) * options.step_scale / 1e3


def run_llm_stage(streams: Streams, shape: ClusterShape, calib: Calibration, rates: ModelRates,
                  rule: ChunkRule, options: SimOptions, window_s: tuple[float, float],
                  delivery_s: np.ndarray | None = None, share: CoreShare | None = None) -> LLMPass:  # fmt: skip
    """Step every LLM replica until its streams are done; log each chunk's cut time. `delivery_s` [N]: per
    stream, how long its chunks take from their cut to the client (a previous pass's detok stage and hops;
    None: the hops and one steady detokenizer step): a finished stream holds its slot, and a starting
    stream its start, until its chunk is delivered, as admission counts them. `share`: the host's cores
    as the pass before left them (None or disabled: each replica owns its device); each step then lasts its
    cost / the share of a core the replica gets."""
    replicas, slots = shape.llm_replicas, shape.max_streams_per_replica
    queues = _queues(streams, route_streams(streams, replicas, rates), replicas)
    state = _Replicas.empty(replicas, slots)
    clock = np.zeros(replicas)
    admitted_s = np.full(streams.count, np.nan)
    logs: list[list[np.ndarray]] = []
    sharing = share is not None and share.enabled
    step_starts: list[np.ndarray] = []
    step_lengths: list[np.ndarray] = []
    load_sum = slot_sum = 0.0
    detok_step_s = typical_detok_step_s(calib, rule, options.detok_scale)
    if delivery_s is None:
        delivery_s = np.full(streams.count, detok_step_s + calib.llm_to_detok_s + calib.detok_to_client_s)
    steps = MeasuredSteps.empty(replicas, slots)
    spread = None
    if options.step_spread and calib.llm_step_spread is not None:
        spread = StepDraws(calib.llm_step_spread, replicas, options.seed)
    trace: list[tuple[np.ndarray, ...]] | None = [] if options.trace_admission else None
    horizon_s = float(streams.arrival_s[-1]) + 60.0 * float(streams.frames.max()) * rates.frame_s
    while True:
        open_rows = (state.stream >= 0).sum(axis=1)
        pending = queues.head < queues.length
        if not (open_rows.any() or pending.any()) or clock.min() > horizon_s:
            break
        idle = (open_rows == 0) & pending
        if idle.any():
            blocked = np.zeros(replicas, bool)
            blocked[idle] = _admit_room(state, shape, steps, clock, rates, _picked(idle))[0] <= 0
            clock = np.where(idle, np.maximum(clock, _next_start_s(state, queues, clock, blocked)), clock)
        waiting = queues.head_arrival() <= clock
        if trace is not None or waiting.any():
            asked = slice(None) if trace is not None else _picked(waiting)
            asked_room, limit, starts_full = _admit_room(state, shape, steps, clock, rates, asked)
            room = np.zeros(replicas, np.int64)  # a replica with no stream waiting starts none
            room[asked] = asked_room
            if trace is not None:  # as admission saw the replicas before this step's starts
                held = waiting & ((room <= 0) | ~state.free(clock).any(axis=1))
                real_time, measured_rows = steps.real_time_streams(clock, rates.real_time_step_s)
                seen = (limit, state.open_streams(clock), held, measured_rows, real_time, starts_full)
            filled = _admit(state, queues, clock, streams, rates.tokens_per_frame, options.admission_wait_s,
                            admitted_s, room)  # fmt: skip
        else:  # no stream waits at any replica: admission has nothing to decide (its limits are pure)
            filled = np.zeros(state.stream.shape, bool)
        live = state.stream >= 0
        priced_s = _step_s(state, filled, calib, options)  # the table's mean step
        if sharing:
            priced_s = priced_s / share.speed(clock, "llm")
        step_s = paced_s = priced_s
        if spread is not None:
            step_s = priced_s * spread.factors(clock)
            # the chunk budget reads the step's EMA (weight 0.1: it follows a spell within ~10 steps), not each step
            paced_s = priced_s * spread.spell_factor
        if sharing:
            busy = live.any(axis=1)
            step_starts.append(clock[busy])
            step_lengths.append(step_s[busy])
        in_window = (clock >= window_s[0]) & (clock < window_s[1])
        load_sum += float((step_s * step_s / rates.real_time_step_s)[in_window].sum())
        slot_sum += float((step_s * live.sum(axis=1))[in_window].sum())
        if trace is not None:
            trace.append((clock.copy(), step_s, *seen))
        clock = clock + step_s
        steps.record(live.sum(axis=1), step_s, clock, ~filled.any(axis=1))
        state.generated += live
        state.cache += live
        cut = _cut_chunks(state, rule, clock, paced_s, rates, detok_step_s, delivery_s)
        if len(cut[0]):
            logs.append(cut)
        done_r, done_c = np.nonzero(live & (state.generated >= state.tokens))
        state.held_until_s[done_r, done_c] = clock[done_r] + delivery_s[state.stream[done_r, done_c]]
        state.stream[done_r, done_c] = -1
    span_s = (window_s[1] - window_s[0]) * replicas
    stream, seq, cut_s, kept, window = (
        [np.concatenate(part) for part in zip(*logs, strict=True)] if logs else [np.empty(0)] * 5
    )
    as_int = [part.astype(np.int64) for part in (stream, seq, kept, window)]
    busy = None
    if sharing:
        busy = share.busy_series(np.concatenate(step_starts), np.concatenate(step_lengths)) if step_starts else None
    admission = None
    if trace:
        admission = AdmissionTrace(*(np.stack(part) for part in zip(*trace, strict=True)))
    return LLMPass(as_int[0], as_int[1], cut_s.astype(np.float64), as_int[2], as_int[3], admitted_s,
                   load_sum / span_s, slot_sum / (span_s * slots), busy, admission)  # fmt: skip


def real_time_rows(calib: Calibration, rates: ModelRates, slots: int, cache_tokens: float, step_scale: float) -> int:
    """The most rows (within `slots`, at least 1) whose step with `cache_tokens` cached keeps real time."""
    rows = np.arange(1, slots + 1)
    step_s = calib.llm_step.step_ms(rows, np.full(slots, cache_tokens)) * calib.pipeline_step_factor * step_scale / 1e3
    fits = rows[step_s <= rates.real_time_step_s]
    return int(fits[-1]) if len(fits) else 1


def _next_start_s(state: _Replicas, queues: _Queues, clock: np.ndarray, blocked: np.ndarray) -> np.ndarray:
    """Per replica with no stream generating, when its next stream can start: its queue's head arrival, and
    no sooner than a held slot frees when every slot is held or the held ones fill its limit (`blocked`)."""
    held = state.held_until_s > clock[:, None]
    first_free_s = np.where(held, state.held_until_s, np.inf).min(axis=1)
    must_wait = (~state.free(clock)).all(axis=1) | (blocked & held.any(axis=1))
    return np.where(must_wait, np.maximum(queues.head_arrival(), first_free_s), queues.head_arrival())


def typical_detok_step_s(calib: Calibration, rule: ChunkRule, detok_scale: float) -> float:
    """The detokenizer step the LLM side budgets for (`StepTimer.detok_s`, an EMA of measured steps): taken
    as one steady window decoded alone, what an unloaded detokenizer measures. Under load the real EMA grows
    and chunks shrink sooner; here the second pass's queueing shows as late chunks instead."""
    steady_window = int(rule.planned[-1]) + rule.left_context_frames + rule.right_context_frames
    return float(calib.detok.batch_ms(steady_window)) * detok_scale / 1e3

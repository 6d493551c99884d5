"""FCFS vs streaming-aware scheduling, simulated on a fake clock: same code, no model, no noise but ours.

The real `Scheduler`, scheduling policy (`make_policy`), `LLMSide` (chunk cutting, adaptive
sizes, the playback clock the policy reads) and `PlaybackTracker` run against two models
instead of torch: a step-time model (ms per LLM step by batch rows, from the CPU preset's
pipeline step EMAs in policy_bench runs) and a detokenizer service-time model (per chunk group
and per window frame, from SNAC on this box). Step times carry a slow drift and per-step noise
from a seeded generator, as the VM's do. A run of 48 requests takes ~0.3 s, so a policy change
is judged over many arrival patterns at once, which `policy_bench` on this VM (whose speed
drifts 20-40% within an hour) cannot do; `policy_bench` then checks the result on the real
pipeline. `--step-scale` shrinks every step to ask what the policy does with more headroom per
stream (a GPU's streams run many times faster than real time; this CPU's run ~1.4x at 4 rows).
Run: `.venv/bin/python -m loadtest.policy_sim --rates 0.5 1.5 1.75 2 --seeds 12`
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

from core.config import CacheConfig, DetokConfig, SchedulerConfig
from core.messages import Job, SamplingParams, TokenChunk
from core.policy import SchedulingPolicy, StepTimer, make_policy
from detok_stage.codecs.snac_codec import SnacCodec
from llm_stage.chunking import ChunkSchedule
from llm_stage.engine import StepOutput
from llm_stage.models.orpheus import TOKENS_PER_FRAME, OrpheusAdapter
from llm_stage.request import Request
from llm_stage.scheduler import Scheduler
from llm_stage.side import LLMSide
from loadtest.policy_bench import RunResult, arrivals, report, summarize
from router.playback import PlaybackTracker

FRAME_S = SnacCodec.samples_per_frame / SnacCodec.sample_rate_hz  # one SNAC frame (Orpheus: 7 tokens)
PROMPT_TOKENS = 20  # a short sentence in Orpheus' prompt format


@dataclass
class StepModel:
    """Seconds per LLM step: ms by decode+prefill rows (linear past the table), plus prefill tokens;
    times a slow drift (AR(1) with a ~2 s time constant, sd `drift`) and per-step noise (sd `noise`)."""

    ms_by_rows: dict[int, float] = field(default_factory=lambda: {1: 5.3, 2: 6.4, 3: 7.6, 4: 8.5})
    ms_per_extra_row: float = 0.4
    ms_per_prefill_token: float = 0.03
    scale: float = 1.0
    drift: float = 0.15
    noise: float = 0.1
    seed: int = 0
    _level: float = 0.0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def step_s(self, rows: int, prefill_tokens: int) -> float:
        top = max(self.ms_by_rows)
        base_ms = self.ms_by_rows.get(rows, self.ms_by_rows[top] + self.ms_per_extra_row * (rows - top))
        seconds = self.scale * (base_ms + self.ms_per_prefill_token * prefill_tokens) / 1e3
        return seconds * self._jitter(seconds)

    def _jitter(self, dt_s: float) -> float:
        keep = math.exp(-dt_s / 2.0)
        self._level = keep * self._level + math.sqrt(1 - keep * keep) * self._rng.gauss(0.0, self.drift)
        return max(0.5, (1 + self._level) * (1 + self._rng.gauss(0.0, self.noise)))


@dataclass
class SimClock:
    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s


class SimEngine:
    """The LLMEngine surface LLMSide uses (`add_job`, `step`, `requests`, `timer`, `adapter`),
    on the real Scheduler and decode order; tokens are dummies, one frame per 7."""

    def __init__(self, config: SchedulerConfig, slots: int, steps: StepModel, clock: SimClock) -> None:
        self.clock, self.steps = clock, steps
        self.timer = StepTimer(steps_per_frame=TOKENS_PER_FRAME)
        self.adapter = SimpleNamespace(steps_per_frame=TOKENS_PER_FRAME)
        self.policy = make_policy(config, self.timer, OrpheusAdapter.head_phase_period, clock)
        cache = CacheConfig(num_slots=slots, max_seq_len=1024)
        self.scheduler = Scheduler(config, cache, [], self.policy)
        self.requests: dict[str, Request] = {}

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_job(self, job: Job, kv: object = None) -> None:
        if kv is not None:
            raise ValueError("the simulated engine holds no KV to migrate")
        req = Request(job.req_id, [1] * PROMPT_TOKENS, job.sampling, arrival_s=self.clock())
        self.requests[job.req_id] = req
        self.scheduler.add(req)

    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:  # the real engine returns at once; the driver loop comes back a moment later
            self.clock.now_s += 1e-3
            return []
        prefill_tokens = sum(w.num_tokens for w in plan.prefills)
        elapsed = self.steps.step_s(len(plan.decodes) + len(plan.prefills), prefill_tokens)
        self.clock.now_s += elapsed
        self.timer.record_step(elapsed, 0 if plan.prefills else len(plan.decodes))
        sampled = plan.sampled_requests
        finished = {id(r) for r in self.scheduler.update(plan, [0] * len(sampled))}
        outputs = []
        for req in sampled:
            frame_done = len(req.output_ids) % TOKENS_PER_FRAME == 0
            frames = [[0] * TOKENS_PER_FRAME] if frame_done else []
            outputs.append(StepOutput(req.req_id, [0], frames, id(req) in finished))
            if id(req) in finished:
                del self.requests[req.req_id]
        return outputs


@dataclass
class DetokModel:
    """One detokenizer worker: takes up to `max_batch_chunks` queued chunks in the engine's order
    (`chunk_priority`: FIFO, or startups then deadlines under `streaming`), decodes them as groups
    of equal window length at `ms_per_group` + `ms_per_window_frame` per frame, and releases them
    together."""

    policy: SchedulingPolicy
    ms_per_group: float = 3.0
    ms_per_window_frame: float = 1.6
    max_batch_chunks: int = 16
    free_at_s: float = 0.0
    queue: list[tuple[float, TokenChunk]] = field(default_factory=list)
    decoded: list[tuple[float, list[TokenChunk]]] = field(default_factory=list)

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.decoded)

    def next_event_s(self) -> float | None:
        times = [t for t, _ in self.decoded]
        if self.queue:
            times.append(max(self.free_at_s, min(t for t, _ in self.queue)))
        return min(times) if times else None

    def run_until(self, until_s: float, timer: StepTimer) -> None:
        while self.queue:
            start = max(self.free_at_s, min(t for t, _ in self.queue))
            if start >= until_s:
                return
            ready = sorted((q for q in self.queue if q[0] <= start), key=self._priority)[: self.max_batch_chunks]
            for item in ready:
                self.queue.remove(item)
            groups = Counter(len(chunk.frames) for _, chunk in ready)  # window length -> chunks
            busy_ms = sum(self.ms_per_group + self.ms_per_window_frame * n * k for n, k in groups.items())
            timer.record_detok(busy_ms / 1e3)
            self.free_at_s = start + busy_ms / 1e3
            self.decoded.append((self.free_at_s, [chunk for _, chunk in ready]))

    def collect(self, now_s: float) -> list[TokenChunk]:
        done = [chunks for t, chunks in self.decoded if t <= now_s]
        self.decoded = [(t, chunks) for t, chunks in self.decoded if t > now_s]
        return [chunk for chunks in done for chunk in chunks]

    def _priority(self, item: tuple[float, TokenChunk]) -> tuple:
        submitted_s, chunk = item
        return self.policy.chunk_priority(chunk, submitted_s)


@dataclass(frozen=True)
class SimSetup:
    batch: int = 4
    slots: int = 16
    startup_concurrency: int = 4
    first_chunk_frames: int = 4
    max_tokens: int = 168
    step_scale: float = StepModel.scale
    drift: float = StepModel.drift
    noise: float = StepModel.noise


def simulate(policy: str, rate: float, count: int, seed: int, setup: SimSetup = SimSetup()) -> RunResult:
    """One Poisson run (the policy_bench arrival pattern of `seed`, scaled to `rate`) on a fake clock."""
    clock = SimClock()
    config = SchedulerConfig(policy=policy, max_batch_size=setup.batch, startup_concurrency=setup.startup_concurrency)
    steps = StepModel(scale=setup.step_scale, drift=setup.drift, noise=setup.noise, seed=seed)
    engine = SimEngine(config, setup.slots, steps, clock)
    schedule = ChunkSchedule.for_policy(DetokConfig(first_chunk_frames=setup.first_chunk_frames), engine.policy)
    side = LLMSide(engine, schedule, clock=clock)
    detok = DetokModel(engine.policy)
    times = arrivals(rate, count, seed)
    trackers: dict[str, PlaybackTracker] = {}
    while len(trackers) < count or engine.has_work or detok.busy:
        while len(trackers) < count and times[len(trackers)] <= clock.now_s:
            req_id = f"r{len(trackers)}"
            trackers[req_id] = PlaybackTracker(clock.now_s)
            side.add(Job(req_id, "", None, SamplingParams(max_tokens=setup.max_tokens), ttfa_deadline_s=5.0))
        if engine.has_work:
            for chunk in side.step():
                detok.queue.append((clock.now_s, chunk))
        else:  # idle: jump to the next arrival or detokenizer event
            detok_event = detok.next_event_s()
            events = [] if detok_event is None else [detok_event]
            events += [times[len(trackers)]] if len(trackers) < count else []
            clock.now_s = max(clock.now_s + 1e-4, min(events))
        detok.run_until(clock.now_s, engine.timer)
        for chunk in detok.collect(clock.now_s):
            frames = chunk.keep_end - chunk.keep_start
            side.mark_audio_sent(chunk.req_id, frames * FRAME_S, frames)
            trackers[chunk.req_id].on_chunk(clock.now_s, frames * FRAME_S)
    return summarize(policy, rate, seed, list(trackers.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.5, 1.75, 2.0])
    parser.add_argument("--seeds", type=int, default=12, help="arrival patterns per rate (seeds 7, 8, ...)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=SimSetup.max_tokens, help="168: 2.05 s of audio")
    parser.add_argument("--policies", nargs="+", default=["fcfs", "streaming"])
    parser.add_argument("--batch", type=int, default=SimSetup.batch)
    parser.add_argument("--startup-concurrency", type=int, default=SimSetup.startup_concurrency)
    parser.add_argument("--step-scale", type=float, default=SimSetup.step_scale, help="step time x (0.4: 2.5x faster)")
    parser.add_argument("--drift", type=float, default=SimSetup.drift, help="sd of the slow step-time drift")
    parser.add_argument("--noise", type=float, default=SimSetup.noise, help="sd of the per-step noise")
    args = parser.parse_args()
    setup = SimSetup(
        batch=args.batch, startup_concurrency=args.startup_concurrency, max_tokens=args.max_tokens,
        step_scale=args.step_scale, drift=args.drift, noise=args.noise,
    )  # fmt: skip
    results = [
        simulate(policy, rate, args.requests, 7 + k, setup)
        for rate in args.rates
        for policy in args.policies
        for k in range(args.seeds)
    ]
    print(report(results))


if __name__ == "__main__":
    main()

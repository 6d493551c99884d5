"""`loadtest.gpu_bench`'s in-process pipeline sections: the streaming sweep (Poisson arrivals,
viability, TTFA, where each stream's time goes) with c=1 TTFA, and throughput mode."""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.batch import BatchItem, run_batch
from cluster.pipeline import InProcessPipeline
from core.config import CacheConfig, DetokConfig, EngineConfig, SchedulerConfig
from detok_stage.codecs.snac_codec import SnacCodec
from llm_stage.models.orpheus import TOKENS_PER_FRAME
from router.playback import PlaybackTracker

if TYPE_CHECKING:
    from llm_stage.engine import LLMEngine
    from loadtest.gpu_bench import BenchRun

FRAME_S = SnacCodec.samples_per_frame / SnacCodec.sample_rate_hz  # 85.3 ms of audio per 7-token frame
TEXTS = (
    "Hello there, how can I help you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech, one chunk at a time, with no gaps.",
)


def has_decode_graphs(engine: LLMEngine) -> bool:
    return getattr(engine.runner, "graphs", None) is not None


def pipeline_config(run: BenchRun, policy: str) -> EngineConfig:
    args = run.args
    scheduler = SchedulerConfig(  # CUDA graphs as production has them: on, sizes derived
        policy=policy, max_batch_size=args.batch, prefill_token_budget=2048,
        startup_concurrency=args.startup_concurrency, async_steps=run.is_cuda,
    )  # fmt: skip
    return EngineConfig(
        model=run.model_config(),
        cache=CacheConfig(num_slots=args.slots or args.batch, max_seq_len=args.max_seq_len),
        scheduler=scheduler,
        detok=DetokConfig(device=args.device, max_batch_chunks=64, async_steps=run.is_cuda, first_chunk_frames=2),
    )


def drain(pipe: InProcessPipeline, limit_s: float = 20.0) -> None:
    start = time.monotonic()
    while pipe.has_work and time.monotonic() - start < limit_s:
        pipe.step()


def lone_ttfa_s(pipe: InProcessPipeline, req_id: str, text: str, max_tokens: int) -> float | None:
    """Time to the first audio of one request alone (then cancelled)."""
    start = time.monotonic()
    pipe.submit(req_id, text, None, {"max_tokens": max_tokens, "seed": 1})
    ttfa = None
    while ttfa is None and pipe.has_work and time.monotonic() - start < 30:
        if any(chunk.req_id == req_id and chunk.duration_s > 0 for chunk in pipe.step()):
            ttfa = time.monotonic() - start
    pipe.cancel(req_id)
    drain(pipe)
    return None if ttfa is None else round(ttfa, 4)


def poisson_arrivals_s(rate: float, count: int, seed: int = 7) -> list[float]:
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


@dataclass
class RateRun:
    """One rate's streams as they play: trackers, finished ids, peak concurrency, audio delivered."""

    arrivals_s: list[float]
    trackers: dict[str, PlaybackTracker] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    peak_active: int = 0  # requests the LLM engine holds (queued or running)
    peak_batch_rows: int = 0
    audio_s: float = 0.0
    pipeline_steps: int = 0  # pipe.step() calls with work (one LLM step each while the engine has work)
    llm_step_s: list[float] = field(default_factory=list)  # wall time of each LLMSide.step inside them
    submitted_unix_s: dict[str, float] = field(default_factory=dict)
    first_cut_s: list[float] = field(default_factory=list)  # submit -> the LLM cut the stream's first chunk
    detok_s: list[float] = field(default_factory=list)  # each chunk: cut -> its audio left the codec
    handback_s: list[float] = field(default_factory=list)  # each chunk: audio ready -> the loop got it

    @property
    def all_sent(self) -> bool:
        return len(self.trackers) == len(self.arrivals_s)


def submit_due(pipe: InProcessPipeline, streams: RateRun, tag: str, elapsed_s: float, max_tokens: int) -> None:
    while not streams.all_sent and streams.arrivals_s[len(streams.trackers)] <= elapsed_s:
        index = len(streams.trackers)
        req_id = f"{tag}-{index}"
        streams.trackers[req_id] = PlaybackTracker(time.monotonic())
        streams.submitted_unix_s[req_id] = time.time()
        pipe.submit(req_id, TEXTS[index % len(TEXTS)], None, {"max_tokens": max_tokens, "seed": index})


def timing_llm_steps(pipe: InProcessPipeline, into: list[float]) -> Callable[[], None]:
    """Record the wall time of each `LLMSide.step` the pipeline makes into `into`; returns the undo."""
    side = pipe.llm
    original = side.step

    def timed_step(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - begin)

    side.step = timed_step
    return lambda: setattr(side, "step", original)


def play_rate(pipe: InProcessPipeline, rate: float, args: argparse.Namespace, cap_s: float) -> tuple[RateRun, float]:
    """Open-loop Poisson arrivals for `args.arrival_s`, until all streams end or `cap_s` passes."""
    streams = RateRun(poisson_arrivals_s(rate, max(2, round(rate * args.arrival_s))))
    undo_timing = timing_llm_steps(pipe, streams.llm_step_s)
    start = time.monotonic()
    while (not streams.all_sent or pipe.has_work) and time.monotonic() - start < cap_s:
        submit_due(pipe, streams, f"r{rate:g}", time.monotonic() - start, args.max_tokens)
        if not pipe.has_work:
            time.sleep(0.001)
            continue
        streams.pipeline_steps += 1
        for chunk in pipe.step():
            tracker = streams.trackers.get(chunk.req_id)
            if tracker is not None:
                if tracker.ttfa_s is None:
                    streams.first_cut_s.append(chunk.hops.chunk_ready_unix_s - streams.submitted_unix_s[chunk.req_id])
                tracker.on_chunk(time.monotonic(), chunk.duration_s)
                streams.audio_s += chunk.duration_s
                streams.detok_s.append(chunk.hops.audio_ready_unix_s - chunk.hops.chunk_ready_unix_s)
                streams.handback_s.append(time.time() - chunk.hops.audio_ready_unix_s)
            if chunk.is_final:
                streams.finished.add(chunk.req_id)
        streams.peak_active = max(streams.peak_active, len(pipe.llm.engine.requests))
        streams.peak_batch_rows = max(streams.peak_batch_rows, pipe.llm.engine.last_batch_size)
    wall_s = time.monotonic() - start
    undo_timing()
    for req_id in set(streams.trackers) - streams.finished:
        pipe.cancel(req_id)
    drain(pipe)
    return streams, wall_s


def rate_summary(streams: RateRun, wall_s: float, cap_s: float) -> dict:
    """Viable: a finished stream that never ran dry; streams cut by the cap or never sent count as not viable."""
    trackers = streams.trackers
    ttfas = sorted(t.ttfa_s for t in trackers.values() if t.ttfa_s is not None)
    viable = sum(t.is_viable and rid in streams.finished for rid, t in trackers.items())
    underruns = [max(t.underruns_s, default=0.0) for t in trackers.values()]
    return {
        "n": len(streams.arrivals_s), "sent": len(trackers), "finished": len(streams.finished),
        "no_audio": len(trackers) - len(ttfas), "capped": wall_s >= cap_s, "wall_s": round(wall_s, 1),
        "p50_ttfa_s": round(statistics.median(ttfas), 3) if ttfas else None,
        "p90_ttfa_s": round(ttfas[min(len(ttfas) - 1, int(0.9 * len(ttfas)))], 3) if ttfas else None,
        "viable_pct": round(100 * viable / len(streams.arrivals_s), 1),
        "peak_active": streams.peak_active, "peak_batch_rows": streams.peak_batch_rows,
        "audio_x_rt": round(streams.audio_s / wall_s, 1),
        "worst_underrun_s": round(max(underruns, default=0.0), 3),
        "pipeline_steps_per_s": round(streams.pipeline_steps / wall_s, 1),
        "llm_step_ms_p50_p90": step_percentiles_ms(streams.llm_step_s),
        "first_chunk_cut_ms_p50_p90": step_percentiles_ms(streams.first_cut_s),
        "chunk_detok_ms_p50_p90": step_percentiles_ms(streams.detok_s),
        "chunk_handback_ms_p50_p90": step_percentiles_ms(streams.handback_s),
    }  # fmt: skip


def step_percentiles_ms(durations_s: list[float]) -> list[float] | None:
    """p50 and p90 in ms (LLM side steps: engine step + chunking, 82 steps/s keep every row real time;
    a stream's first chunk cut after its submit; a chunk's detokenizer time and hand-back)."""
    if not durations_s:
        return None
    ordered = sorted(durations_s)
    return [round(1e3 * ordered[int(q * (len(ordered) - 1))], 2) for q in (0.5, 0.9)]


def streaming_section(run: BenchRun) -> dict:
    args = run.args
    pipe = InProcessPipeline(pipeline_config(run, "streaming"))
    out = {"batch": args.batch, "slots": args.slots or args.batch, "max_seq_len": args.max_seq_len,
           "startup_concurrency": args.startup_concurrency, "max_tokens": args.max_tokens,
           "audio_s_per_stream": round(args.max_tokens / TOKENS_PER_FRAME * FRAME_S, 2),
           "graphs_captured": has_decode_graphs(pipe.llm.engine),
           "built_at_s": round(run.elapsed_s(), 1)}  # fmt: skip
    try:
        out["c1_ttfa_s"] = [lone_ttfa_s(pipe, f"c1-{i}", TEXTS[i % len(TEXTS)], args.max_tokens) for i in range(4)]
        out["rates"] = {}
        for index, rate in enumerate(args.rates):
            cap_s = min(args.rate_cap_s, run.time_left_s() / (len(args.rates) - index))
            if cap_s < 2:
                out["rates"][f"{rate:g}"] = {"skipped": "out of time"}
                continue
            out["rates"][f"{rate:g}"] = rate_summary(*play_rate(pipe, rate, args, cap_s), cap_s)
            run.say(f"  rate {rate:g}/s: {out['rates'][f'{rate:g}']}")
            run.save_partial(out)
    finally:
        pipe.close()
    warm = [t for t in out["c1_ttfa_s"][1:] if t is not None]
    out["c1_warm_ttfa_s"] = round(statistics.median(warm), 4) if warm else None
    return out


def throughput_section(run: BenchRun) -> dict:
    count = run.args.throughput_requests or run.args.batch
    items = [BatchItem(f"t{i}", f"Throughput mode sentence number {i}.", None) for i in range(count)]
    with tempfile.TemporaryDirectory() as wav_dir:
        done = run_batch(pipeline_config(run, "throughput"), items, Path(wav_dir), {"max_tokens": run.args.max_tokens})
    return {"requests": count, "audio_s": round(done.audio_s, 1), "wall_s": round(done.wall_s, 1),
            "x_real_time": round(done.x_real_time, 1)}  # fmt: skip

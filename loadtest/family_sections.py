"""The measurements `loadtest.family_gpu_bench` takes of one family entry, each a function of a `FamilyRun`.

Decode step ms (eager vs CUDA graphs) per batch rows, the detokenizer's cost per second of audio per batch,
the in-process pipeline (c=1 TTFA, one stream's x-real-time, Poisson rates and the capacity at the SLO),
throughput mode, CFG retention (seed 004's measure: the same batch with and without guidance) and, on a
GPU, the check that graphs give eager's tokens. They reuse the Orpheus GPU bench's pieces
(`loadtest.gpu_bench`: step engines and timing; `loadtest.gpu_bench_pipeline`: rates and their summary).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cluster.batch import BatchItem, run_batch
from cluster.pipeline import InProcessPipeline
from core.config import CacheConfig, SchedulerConfig
from core.graphs import GraphCache, graphs_available
from detok_stage.codecs.base import CodecAdapter
from llm_stage.engine import LLMEngine
from llm_stage.models.base import LMAdapter
from loadtest.cfg_bench import run_once
from loadtest.flow_bench import request_chunks
from loadtest.gpu_bench import StepCase, generate_until, step_engine, timed_ms, timed_steps
from loadtest.gpu_bench_pipeline import TEXTS, drain, lone_ttfa_s, pipeline_config, play_rate, rate_summary
from loadtest.metrics import highest_rate_meeting

if TYPE_CHECKING:
    from loadtest.family_gpu_bench import FamilyRun

STEP_WARM_TOKENS = 8  # decoded before the timed steps
STEP_MAX_SEQ_LEN = 512  # prompt + warm-up + timed steps fit


@contextmanager
def never_stopping(adapter: LMAdapter) -> Iterator[LMAdapter]:
    """`adapter` whose streams run to `max_tokens` (random weights stop at random): equal work per mode."""
    adapter.is_stop = lambda req, token: False  # type: ignore[method-assign]
    try:
        yield adapter
    finally:
        del adapter.is_stop  # the class's rule again


def rows_per_stream(run: FamilyRun) -> int:
    return 2 if run.entry.guided else 1


# --- decode step per rows, eager vs graphs ------------------------------------------------------------------


# a family with an inner loop per frame (CSM, Qwen3-TTS): the backbone's graphs with the frame's codebooks drawn
# per codebook on the host (the path before `llm_stage.inner_loop`), against "graphs" (the inner loop's graphs too)
HOST_FRAMES = "graphs-host-frames"


def step_case(run: FamilyRun, case: StepCase) -> dict:
    """Steady steps of `case.rows` batch rows (guided families: rows / 2 streams, each with its twin)."""
    streams = max(1, case.rows // rows_per_stream(run))
    rows = streams * rows_per_stream(run)  # one guided stream takes 2 rows even where 1 was asked
    max_tokens = STEP_WARM_TOKENS + 40
    host_frames = case.mode == HOST_FRAMES  # the backbone's graphs, the inner loop drawn per codebook on the host
    steps = StepCase("graphs" if host_frames else case.mode, rows, case.max_seq_len)
    with never_stopping(run.adapter) as adapter:
        engine = step_engine(adapter, steps, chain_frames=False if host_frames else None)
        try:
            sampling = {"max_tokens": max_tokens}
            for i in range(streams):
                engine.add_request(f"s{i}", TEXTS[i % len(TEXTS)], None, {**sampling, "seed": i})
            generate_until(engine, STEP_WARM_TOKENS)
            step_ms, rows = timed_steps(run, engine)
        finally:
            engine.close()
    return {"step_ms": round(step_ms, 3), "rows_per_step": round(rows, 1), "streams": streams}


def step_ms_section(run: FamilyRun) -> dict:
    args, results = run.args, []
    modes = ("graphs", "eager", HOST_FRAMES) if run.adapter.inner_loop is not None else ("graphs", "eager")
    cases = [StepCase(mode, rows, STEP_MAX_SEQ_LEN) for rows in args.rows for mode in modes]
    for case in cases:
        if case.mode != "graphs" and case.rows not in args.eager_rows:
            continue
        row = {"mode": case.mode, "rows": case.rows}
        if run.time_left_s() < 1:
            results.append({**row, "skipped": "out of time"})
            continue
        try:
            row |= step_case(run, case)
        except Exception as err:  # an OOM or a capture failure ends this case, not the section
            row["error"] = repr(err)[:400]
        results.append(row)
        run.say(f"  {run.entry.key} step {case.mode} rows={case.rows}: {row.get('step_ms', row)}")
    real_time_ms = run.frame_s / run.steps_per_frame * 1e3
    return {"results": results, "real_time_step_ms": round(real_time_ms, 2), "max_seq_len": STEP_MAX_SEQ_LEN}


# --- detokenizer cost per second of audio -------------------------------------------------------------------


def detok_section(run: FamilyRun) -> dict:
    """`codec.decode` of windows of `--detok-window-s` of audio, per batch: ms, and ms per second of audio;
    on CUDA, for a stateless codec, also its CUDA graph of that window (what a detok replica replays,
    `detok_stage.graphs`): ms and the largest difference from the eager audio."""
    codec, out = run.codec, {}
    frames = max(1, round(run.args.detok_window_s / run.frame_s))
    graphs = window_graphs(run)
    for batch in run.args.detok_batches:
        if run.time_left_s() < 0.5:
            out[str(batch)] = {"skipped": "out of time"}
            continue
        codes = torch.randint(0, codec.codebook_size, (batch, frames, codec.codes_per_frame))
        ms = timed_ms(run, lambda c=codes: codec.decode(c), repeats=run.args.detok_repeats)
        audio_s = batch * frames * run.frame_s
        per_audio_s = round(ms / audio_s, 3)
        out[str(batch)] = {"ms": round(ms, 2), "ms_per_audio_s": per_audio_s, "x_rt": round(audio_s / ms * 1e3, 1)}
        if graphs is not None:
            out[str(batch)] |= graph_figures(run, graphs, codes, audio_s)
    streamed = streamed_section(run) if has_own_graphs(run.codec) else None
    return {"window_frames": frames, "by_batch": out, "graphs": graphs is not None} | (
        {"streamed": streamed} if streamed is not None else {}
    )


# --- a stateful codec with its own graphs (S3Gen): streamed rounds, eager vs graphs ---------------------------

STREAMED_CHUNK_ROUNDS = 3  # chunk rounds per stream (whole 25-token attention chunks for S3Gen)
# exact streaming keeps every frame's keys for every Euler step (~176 MB per audio second at the published
# shapes): 64 streams of 3 s would hold ~34 GB, doubled by the pools' growth; larger batches are skipped
STREAMED_MAX_BATCH = 16


def has_own_graphs(codec) -> bool:
    return codec.is_stateful and type(codec).enable_graphs is not CodecAdapter.enable_graphs


def streamed_pass(codec, batch: int, tag: str) -> tuple[float, list[torch.Tensor]]:
    """`batch` streams decoded together, chunk round by chunk round: (ms, each stream's audio)."""
    chunk = codec.config.chunk_tokens
    # stream i's tokens depend on i only: each pass decodes the same streams
    streams = [request_chunks(f"{tag}-{batch}-{i}", STREAMED_CHUNK_ROUNDS * chunk, chunk, codec.codebook_size, seed=i)
               for i in range(batch)]  # fmt: skip
    audio: list[list[torch.Tensor]] = [[] for _ in streams]
    start = time.perf_counter()
    for index in range(max(len(c) for c in streams)):
        for i, wave in enumerate(codec.decode_stream([c[index] for c in streams])):
            audio[i].append(wave)  # (decode_stream hands back CPU audio: the device has finished)
    return (time.perf_counter() - start) * 1e3, [torch.cat(a) for a in audio]


def streamed_section(run: FamilyRun) -> dict:
    """S3Gen's streamed rounds at each detok batch: eager, then (on CUDA) through the flow's graphs
    (`detok_stage.flow.flow_graphs`, captured at the batch sizes first, then one untimed pass for the key
    buckets): ms per second of audio, and the graphs' largest difference from eager's audio."""
    codec, batches, out = run.codec, list(run.args.detok_batches), {}
    codec.model.flow.graphs = None
    eager = {}
    for batch in batches:
        if batch > STREAMED_MAX_BATCH or run.time_left_s() < 1.0:
            out[str(batch)] = {"skipped": "out of time" if batch <= STREAMED_MAX_BATCH else "flow KV (exact streaming)"}
            continue
        ms, eager[batch] = streamed_pass(codec, batch, "eager")
        audio_s = sum(a.numel() for a in eager[batch]) / codec.sample_rate_hz
        out[str(batch)] = {"eager_ms_per_audio_s": round(ms / audio_s, 3), "audio_s": round(audio_s, 2)}
    if not graphs_available(run.args.device) or not eager:
        return {"rounds": STREAMED_CHUNK_ROUNDS, "by_batch": out, "graphs": False}
    codec.enable_graphs(sorted(eager))
    for batch, want in eager.items():
        if run.time_left_s() < 1.0:
            break
        streamed_pass(codec, batch, "graphs-warm")
        ms, got = streamed_pass(codec, batch, "graphs")
        audio_s = sum(a.numel() for a in got) / codec.sample_rate_hz
        diff = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
        out[str(batch)] |= {"graphs_ms_per_audio_s": round(ms / audio_s, 3), "graphs_max_abs_diff": diff}
    return {"rounds": STREAMED_CHUNK_ROUNDS, "by_batch": out, "graphs": True}


def window_graphs(run: FamilyRun) -> GraphCache | None:
    """The codec's device decode as CUDA graphs (None: not on CUDA, or a stateful codec: it decodes eagerly)."""
    if not (graphs_available(run.args.device) and run.codec.captures_windows):
        return None
    return GraphCache(run.codec.decode_on_device, "bench detok")


def graph_figures(run: FamilyRun, graphs: GraphCache, codes: torch.Tensor, audio_s: float) -> dict:
    """One window batch replayed from its graph: ms, ms per audio second, max |graph - eager|."""
    on_device = codes.to(run.args.device)
    if not graphs.capture([on_device]):
        return {"graphs": "capture failed (logged)"}
    ms = timed_ms(run, lambda: graphs(on_device), repeats=run.args.detok_repeats)
    diff = (graphs(on_device).float().cpu() - run.codec.decode(codes)).abs().max().item()
    return {"graphs_ms": round(ms, 2), "graphs_ms_per_audio_s": round(ms / audio_s, 3), "graphs_max_abs_diff": diff}


# --- the in-process pipeline: c=1, one stream, rates, throughput ----------------------------------------------


def one_stream_x_rt(pipe: InProcessPipeline, max_tokens: int, limit_s: float) -> dict:
    """One request alone from submit to its final chunk: audio seconds per wall second."""
    start, audio_s, finished = time.monotonic(), 0.0, False
    pipe.submit("one", TEXTS[0], None, {"max_tokens": max_tokens, "seed": 3})
    while pipe.has_work and not finished and time.monotonic() - start < limit_s:
        for chunk in pipe.step():
            audio_s += chunk.duration_s
            finished = finished or chunk.is_final
    wall_s = time.monotonic() - start
    if not finished:
        pipe.cancel("one")
    drain(pipe)
    return {"audio_s": round(audio_s, 2), "wall_s": round(wall_s, 2), "x_rt": round(audio_s / wall_s, 2),
            "finished": finished}  # fmt: skip


@dataclass(frozen=True)
class RatePoint:
    rate_rps: float
    figures: dict


@dataclass(frozen=True)
class SloRule:
    """A rate meets it when its p90 TTFA is at most `p90_ttfa_s` and at least `viable_pct` of its streams are
    viable (`rate_summary`: a stream cut by the cap or never sent is not)."""

    p90_ttfa_s: float
    viable_pct: float

    def met(self, point: RatePoint) -> bool:
        p90, viable = point.figures.get("p90_ttfa_s"), point.figures.get("viable_pct")
        return p90 is not None and viable is not None and p90 <= self.p90_ttfa_s and viable >= self.viable_pct

    def as_dict(self) -> dict:
        return {"p90_ttfa_s": self.p90_ttfa_s, "viable_pct": self.viable_pct}


FAMILY_SLO = SloRule(p90_ttfa_s=0.5, viable_pct=99.0)  # DESIGN §1: capacity at SLO on a GPU


def rate_needs_s(args: argparse.Namespace) -> float:
    """A rate's wall time for its last arrival's stream to play out: the arrivals, one stream's audio at
    real time, and a second for its first chunk and the last decode."""
    return args.arrival_s + args.stream_audio_s + 1.0


def rates_at(
    run: FamilyRun, pipe: InProcessPipeline, rates: list[float] | None = None, rule: SloRule = FAMILY_SLO,
    stop_after_miss: bool = False,
) -> dict:  # fmt: skip
    """Each rate of `rates` (default `--rates`), lowest first, within the section's time; the capacity is the
    highest rate meeting `rule` with every lower one meeting it. `stop_after_miss`: rates above a miss are skipped.
    A rate runs only with the time its last stream needs to play out (`rate_needs_s`): cut short, its streams
    would count as not viable and read as a capacity of 0. The lower rates take the time first; the higher
    ones left without it are skipped, saying so."""
    rates, out, points = list(run.args.rates if rates is None else rates), {}, []
    needs_s = rate_needs_s(run.args)
    for index, rate in enumerate(rates):
        left_s = run.time_left_s()
        cap_s = min(run.args.rate_cap_s, max(left_s / (len(rates) - index), needs_s))
        if points and stop_after_miss and not rule.met(points[-1]):
            out[f"{rate:g}"] = {"skipped": "a lower rate missed the SLO"}
            continue
        if left_s < needs_s:
            out[f"{rate:g}"] = {"skipped": f"out of time: a rate needs {needs_s:.0f} s, {left_s:.0f} s left"}
            continue
        figures = rate_summary(*play_rate(pipe, rate, run.args, cap_s), cap_s)
        out[f"{rate:g}"] = figures
        points.append(RatePoint(rate, figures))
        run.say(f"  {run.entry.key} rate {rate:g}/s: p90 {figures['p90_ttfa_s']} s, viable {figures['viable_pct']}%")
    return {"rates": out, "capacity_at_slo_rps": highest_rate_meeting(points, rule.met)}


def streaming_section(run: FamilyRun) -> dict:
    """c=1 TTFA (first is cold), one stream's x-RT, then the Poisson rates on one streaming pipeline."""
    args = run.args
    pipe = InProcessPipeline(pipeline_config(run, "streaming"))
    try:
        c1 = [lone_ttfa_s(pipe, f"c1-{i}", TEXTS[i % len(TEXTS)], args.max_tokens) for i in range(args.c1_repeats)]
        one = one_stream_x_rt(pipe, args.max_tokens, limit_s=max(5.0, run.time_left_s() / 3))
        out = {"c1_ttfa_s": c1, "one_stream": one, "max_tokens": args.max_tokens, "slo": FAMILY_SLO.as_dict()}
        out |= rates_at(run, pipe)
    finally:
        pipe.close()
    warm = [t for t in c1[1:] if t is not None]
    out["c1_warm_ttfa_s"] = round(statistics.median(warm), 4) if warm else None
    return out


def throughput_section(run: FamilyRun) -> dict:
    count = run.args.throughput_requests
    items = [BatchItem(f"t{i}", f"Throughput mode sentence number {i}.", None) for i in range(count)]
    with tempfile.TemporaryDirectory() as wav_dir:
        done = run_batch(pipeline_config(run, "throughput"), items, Path(wav_dir), {"max_tokens": run.args.max_tokens})
    return {"requests": count, "audio_s": round(done.audio_s, 1), "wall_s": round(done.wall_s, 1),
            "x_real_time": round(done.x_real_time, 1)}  # fmt: skip


# --- CFG retention (Dia, Chatterbox) ---------------------------------------------------------------------------


def cfg_point(run: FamilyRun, streams: int, scale: float) -> dict:
    """Seed 004's measure at `streams`: the same streams with and without guidance, audio tokens/s each."""
    ns = argparse.Namespace(concurrency=streams, max_tokens=run.args.cfg_tokens, device=run.args.device,
                            prompt_room=run.args.prompt_room)  # fmt: skip
    with never_stopping(run.adapter) as adapter:
        plain, guided = run_once(adapter, ns, None), run_once(adapter, ns, scale)
    codebooks = run.adapter.num_codebooks
    out = {}
    for name, result in (("no_cfg", plain), ("cfg", guided)):
        audio_s = result["audio_tokens"] / codebooks * run.frame_s
        out[name] = {"tokens_per_s": round(result["tokens_per_s"], 1), "x_rt": round(audio_s / result["seconds"], 2)}
    out["retention"] = round(guided["tokens_per_s"] / plain["tokens_per_s"], 3) if plain["tokens_per_s"] else None
    return out


def cfg_section(run: FamilyRun) -> dict:
    if not run.entry.guided:
        return {"skipped": "no CFG in this family"}
    scale = run.adapter.default_sampling.guidance_scale or 3.0
    out: dict = {"guidance_scale": scale, "max_tokens": run.args.cfg_tokens, "by_streams": {}}
    for streams in run.args.cfg_streams:
        if run.time_left_s() < 1:
            out["by_streams"][str(streams)] = {"skipped": "out of time"}
            continue
        out["by_streams"][str(streams)] = cfg_point(run, streams, scale)
        run.say(f"  {run.entry.key} cfg {streams} streams: retention {out['by_streams'][str(streams)]['retention']}")
    return out


# --- on a GPU: graphs give eager's tokens ---------------------------------------------------------------------


def tokens_of(
    adapter: LMAdapter, graphs: bool, sampling: dict, streams: int, chain_frames: bool | None = None
) -> dict[str, list]:
    """Every stream's tokens; `chain_frames`: the engine's `chain_frames_on_device` (None: on a GPU)."""
    rows = streams * 2  # room for CFG twins
    scheduler = SchedulerConfig(max_batch_size=rows, prefill_token_budget=4096, cuda_graphs=graphs)
    cache = CacheConfig(num_slots=rows, max_seq_len=256)
    engine = LLMEngine(adapter, cache, scheduler, chain_frames_on_device=chain_frames)
    try:
        for i in range(streams):
            engine.add_request(f"p{i}", TEXTS[i % len(TEXTS)], None, {**sampling, "seed": 50 + i})
        return engine.run_to_completion()
    finally:
        engine.close()


PARITY_SAMPLING = (("greedy", {"temperature": 0.0}), ("seeded", {}))


def parity_section(run: FamilyRun) -> dict:
    """Greedy and seeded: CUDA graphs (the served default on CUDA) give eager's tokens, CFG pairs and a
    frame's inner loop (CSM, Qwen3-TTS: one graph per batch size) included. On CPU: the inner loop chained
    on the device (what its graphs capture) gives the host draws' tokens."""
    if not run.is_cuda:
        return inner_loop_parity(run)
    out: dict = {}
    with never_stopping(run.adapter) as adapter:
        for name, sampling in PARITY_SAMPLING:
            sampling = {**sampling, "max_tokens": run.args.parity_tokens}
            eager = tokens_of(adapter, False, sampling, run.args.parity_streams)
            out[name] = tokens_of(adapter, True, sampling, run.args.parity_streams) == eager
    out["ok"] = all(out.values())
    if adapter.inner_loop is not None:
        out["inner_loop_graphs"] = adapter.inner_loop.num_captured
    return out


def inner_loop_parity(run: FamilyRun) -> dict:
    """CPU: a family's inner loop chained on the device (static KV cache, device draws) vs the host draws."""
    if run.adapter.inner_loop is None:
        return {"skipped": "n/a (cpu: graphs fall back to eager)"}
    out: dict = {}
    with never_stopping(run.adapter) as adapter:
        for name, sampling in PARITY_SAMPLING:
            sampling = {**sampling, "max_tokens": run.args.parity_tokens}
            host = tokens_of(adapter, False, sampling, run.args.parity_streams, chain_frames=False)
            out[f"inner_loop_{name}"] = tokens_of(adapter, False, sampling, run.args.parity_streams, True) == host
    out["ok"] = all(out.values())
    return out

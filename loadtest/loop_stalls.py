"""Where a served replica's time goes under open-loop load: its serving loop's steps, the gaps between them
and its process's collections, per swept rate (issue 40: what the planner's model of a replica lacks).

Serves a plan_check configuration (`voxray serve` as a process), sweeps Poisson rates with the sweep's
prompts, and after each rate reads every replica's `loop_trace()` for the rate's seconds. Per rate and loop:
the share of the time in steps, in gaps while work waited and idle; each batch size's step (median, mean,
p99) against the calibration's line where one is given; and stalls: cycles (gap + step) longer than
`STALL_FACTOR` x their size's median step, with their excess over that median per second of load. And what
held new streams back: an LLM replica's load (whichever answers) read every `SAMPLE_S`, run through
`router.admission`; and the streams whose playback ran dry (`late_streams`: when sent, at which chunk), every
stream's chunk arrivals kept in the JSON.
Starts Ray: never run it beside another benchmark.
Usage: python -m loadtest.loop_stalls --out bench_out/loop_stalls --rates 1.1 1.4 1.8 [--calibration F]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

STALL_FACTOR = 3.0  # a cycle this many times its size's median step is a stall
MIN_STALL_S = 0.01  # and at least this much longer than the median (1-row CPU steps are ~1 ms)
MIN_STEPS_PER_SIZE = 50  # a batch size's mean cycle counts once it stepped this often
SPREAD_POINTS = 40  # equally likely values a calibration keeps of its steps' spread (`cycle_spread`)
SPELL_S = 0.5  # the steps' spread is kept as spells this long (their means) and the steps within them
MIN_STEPS_PER_SPELL = 10  # a window with fewer steps was mostly idle: not a spell
SAMPLE_S = 0.25  # the LLM replica's load is read this often over a rate
READ_CALLS = 8  # calls to a stage's handle for its replicas' traces (each reaches one replica)
LATE_SHOWN = 8  # late streams a rate's report lists (the JSON keeps every stream's chunks)


@dataclass(frozen=True)
class SizeSteps:
    size: int
    count: int
    median_ms: float
    mean_ms: float
    p99_ms: float
    mean_cycle_ms: float  # gap + step: what one more step costs the streams
    line_ms: float | None = None  # the calibration's serving-loop step at this size


@dataclass(frozen=True)
class LoopShare:
    """One stage's loop over one rate's seconds."""

    span_s: float
    steps: int
    step_share: float  # of the span
    gap_share: float
    stalls_per_s: float
    stall_excess_share: float  # the stalls' time past their size's median, of the span
    stall_excess_ms: tuple[float, ...]  # each stall's excess, descending (the 20 longest)
    gc_pauses_per_s: float
    gc_share: float
    gc_longest_ms: float
    by_size: tuple[SizeSteps, ...]


def loop_share(trace: dict, start_s: float, end_s: float, line_ms=None) -> LoopShare:
    """Summarize `trace` (a `LoopTrace.snapshot`) between two monotonic stamps; `line_ms(size)` gives the
    calibration's step for a size (None: no comparison)."""
    starts = np.asarray(trace["start_s"], np.float64)
    keep = (starts >= start_s) & (starts < end_s)
    step = np.asarray(trace["step_s"], np.float64)[keep]
    gap = np.asarray(trace["gap_s"], np.float64)[keep]
    size = np.asarray(trace["size"], np.int64)[keep]
    span_s = max(end_s - start_s, 1e-9)
    medians = {int(n): float(np.median(step[size == n])) for n in np.unique(size)}
    median_of = np.asarray([medians[int(n)] for n in size], np.float64)
    excess = gap + step - median_of
    stalls = excess[(gap + step > STALL_FACTOR * median_of) & (excess > MIN_STALL_S)]
    gc_start = np.asarray(trace["gc_start_s"], np.float64)
    gc_pause = np.asarray(trace["gc_pause_s"], np.float64)[(gc_start >= start_s) & (gc_start < end_s)]
    return LoopShare(
        span_s=round(span_s, 2), steps=int(keep.sum()),
        step_share=float(step.sum() / span_s), gap_share=float(gap.sum() / span_s),
        stalls_per_s=len(stalls) / span_s, stall_excess_share=float(stalls.sum() / span_s),
        stall_excess_ms=tuple(round(1e3 * float(x), 1) for x in sorted(stalls, reverse=True)[:20]),
        gc_pauses_per_s=len(gc_pause) / span_s, gc_share=float(gc_pause.sum() / span_s),
        gc_longest_ms=float(1e3 * gc_pause.max()) if len(gc_pause) else 0.0,
        by_size=tuple(_size_steps(n, step[size == n], gap[size == n], line_ms) for n in sorted(medians)),
    )  # fmt: skip


def _size_steps(size: int, step: np.ndarray, gap: np.ndarray, line_ms) -> SizeSteps:
    return SizeSteps(
        size=size, count=len(step), median_ms=1e3 * float(np.median(step)), mean_ms=1e3 * float(step.mean()),
        p99_ms=1e3 * float(np.percentile(step, 99)), mean_cycle_ms=1e3 * float((gap + step).mean()),
        line_ms=None if line_ms is None else float(line_ms(size)),
    )  # fmt: skip


def _decode_cycles(trace: dict) -> tuple[np.ndarray, np.ndarray]:
    """(batch size, or 0 for a step that prefilled; cycle s = gap + step) of every step in `trace`."""
    size = np.where(np.asarray(trace["decode_only"], bool), np.asarray(trace["size"], np.int64), 0)
    return size, np.asarray(trace["gap_s"], np.float64) + np.asarray(trace["step_s"], np.float64)


def mean_cycle_ms_by_size(trace: dict, min_steps: int = MIN_STEPS_PER_SIZE) -> dict[int, float]:
    """Per batch size stepped at least `min_steps` times in decode-only steps, the mean of their cycles (the
    gap before a step and the step) in ms: what a step of that size costs the streams, its stalls and slow
    tails included (a step with prompt work is priced apart: the planner adds a prompt's prefill)."""
    size, cycle = _decode_cycles(trace)
    sizes, counts = np.unique(size[size > 0], return_counts=True)
    return {int(n): round(1e3 * float(cycle[size == n].mean()), 3) for n, c in zip(sizes, counts, strict=True)
            if c >= min_steps}  # fmt: skip


def cycle_spread(trace: dict, points: int = SPREAD_POINTS, spell_s: float = SPELL_S,
                 min_steps: int = MIN_STEPS_PER_SIZE) -> dict | None:  # fmt: skip
    """How the decode-only cycles scatter around their batch size's mean (the sizes `mean_cycle_ms_by_size`
    keeps), in two parts, since slow steps come in spells (2026-12-07, the 1x1 at 1.0-1.3 req/s: a cycle's
    correlation with the next 0.5, with the 50th after it 0.1; the means of 0.5 s windows spread 3x what
    independent steps would give): `spells`, each `spell_s` window's mean cycle over the sizes' means, and
    `steps`, each cycle over its window's mean; each as `points` equally likely values (the quantiles at the
    middle of each 1 / `points` of probability) scaled to mean exactly 1, ascending. None with no size kept.
    The planner draws a factor from `spells` every `spell_s` and one from `steps` every step
    (`llm.step_spread`): the steps are right-skewed (8 rows: median 0.86 of the mean) and admission paces on
    the median."""
    size, cycle = _decode_cycles(trace)
    kept = mean_cycle_ms_by_size(trace, min_steps)
    if not kept:
        return None
    chosen = np.isin(size, list(kept))
    means = {n: cycle[size == n].mean() for n in kept}
    relative = cycle[chosen] / np.asarray([means[n] for n in size[chosen]])
    start_s = np.asarray(trace["start_s"], np.float64)[chosen]
    window = np.floor((start_s - start_s.min()) / spell_s).astype(np.int64)
    counts = np.bincount(window)
    window_mean = np.bincount(window, weights=relative) / np.maximum(counts, 1)
    full = counts[window] >= MIN_STEPS_PER_SPELL  # windows with a few steps only: idle time, not a spell
    if not full.any():
        return None
    spells = window_mean[counts >= MIN_STEPS_PER_SPELL]
    steps = relative[full] / window_mean[window[full]]
    return {"spell_s": spell_s, "spells": _equally_likely(spells, points), "steps": _equally_likely(steps, points)}


def _equally_likely(values: np.ndarray, points: int) -> list[float]:
    """`points` quantiles of `values` at the middle of each 1 / `points` of probability, scaled to mean 1."""
    quantiles = np.quantile(values, (np.arange(points) + 0.5) / points)
    return [round(float(v), 4) for v in quantiles / quantiles.mean()]


def calibration_line(path: Path):
    """The calibration's serving-loop step by rows (its table at the first cache column x its pipeline
    factor), as a function of the batch size."""
    from cluster.planner.calibration import load_calibration

    calib = load_calibration(path)
    column = calib.llm_step.cache_tokens[0]
    return lambda rows: float(calib.llm_step.step_ms(np.asarray([rows]), np.asarray([column]))[0]
                              * calib.pipeline_step_factor)  # fmt: skip


@dataclass(frozen=True)
class AdmissionShare:
    """What held new streams back on the LLM replica over one rate, from its load sampled every
    `SAMPLE_S` (`router.admission` on each sample): the share of samples at each state."""

    samples: int
    full: float  # open streams >= the stream limit
    full_by_detok: float  # ... where the detok stage's cap set that limit
    full_by_pace: float  # ... where the LLM's own measured pace did
    full_by_starving: float  # ... where a stream behind froze it
    starts_full: float  # as many starting as `starting_allowed`
    mean_limit: float
    mean_detok_limit: float | None  # the detok cap's mean where measured
    mean_active: float
    mean_measured_rows: float = 0.0  # the largest measured batch admission paced by (`measured_streams`)
    mean_real_time_streams: float = 0.0  # the streams that batch's median step keeps at real time


def admission_share(loads: list[dict]) -> AdmissionShare:
    """Summarize sampled `LLMStage.stats()` readings."""
    from router.admission import ReplicaLoad, detok_stream_limit, limits_startups, starting_allowed, stream_limit

    rows = []
    for stats in loads:
        load = ReplicaLoad.from_stats(stats)
        if load is None:
            continue
        limit, detok = stream_limit(load), detok_stream_limit(load)
        full = load.num_active >= limit
        starts_full = limits_startups(load) and load.num_starting >= starting_allowed(load)
        rows.append((full, full and detok is not None and detok <= limit, full and load.num_starving > 0,
                     starts_full, limit, detok, load.num_active, load.measured_streams,
                     load.real_time_streams))  # fmt: skip
    if not rows:
        return AdmissionShare(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, None, 0.0)
    n = len(rows)
    full = [r for r in rows if r[0]]
    by_detok, by_starving = sum(r[1] for r in rows), sum(r[2] for r in rows)
    detoks = [r[5] for r in rows if r[5] is not None]
    return AdmissionShare(
        samples=n, full=len(full) / n, full_by_detok=by_detok / n, full_by_starving=by_starving / n,
        full_by_pace=sum(1 for r in full if not r[1] and not r[2]) / n, starts_full=sum(r[3] for r in rows) / n,
        mean_limit=sum(r[4] for r in rows) / n, mean_detok_limit=sum(detoks) / len(detoks) if detoks else None,
        mean_active=sum(r[6] for r in rows) / n, mean_measured_rows=sum(r[7] for r in rows) / n,
        mean_real_time_streams=sum(r[8] for r in rows) / n,
    )  # fmt: skip


@dataclass(frozen=True)
class LateStream:
    """One stream whose playback ran dry, as its client saw it (`loadtest.metrics`' lateness)."""

    sent_s: float  # when it was to be sent, s into the rate's arrivals
    ttfa_s: float
    first_late: int  # the first late audio chunk's index (1: the second chunk)
    late_chunks: int
    worst_s: float
    played_s: tuple[float, ...]  # the audio seconds of its chunks up to and including the first late one


def late_streams(requests: list[dict]) -> list[LateStream]:
    """The streams of one rate (the sweep's request records, as dicts) whose playback ran dry, in the
    order they were sent: when, how soon their audio began, and at which chunk they first fell behind."""
    from loadtest.metrics import audio_chunks, chunk_lateness_s

    out = []
    for request in sorted(requests, key=lambda r: r["scheduled_at_s"]):
        arrivals, durations = request["arrivals_s"], request["durations_s"]
        lateness = chunk_lateness_s(arrivals, durations)
        late = [i + 1 for i, value in enumerate(lateness) if value > 0]
        if not request["is_ok"] or not late:
            continue
        chunks = audio_chunks(arrivals, durations)
        played_s = tuple(round(d, 3) for _, d in chunks[: late[0] + 1])
        out.append(LateStream(round(request["scheduled_at_s"], 3), round(chunks[0][0], 3), late[0], len(late),
                              round(max(lateness), 3), played_s))  # fmt: skip
    return out


class LoadSampler:
    """Reads the LLM replica's `stats()` every `SAMPLE_S` on a thread (call inside `join_cluster`)."""

    def __init__(self, app_name: str = "voxray") -> None:
        import threading

        from ray import serve

        self._handle = serve.get_deployment_handle("LLMStage", app_name)
        self.loads: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                self.loads.append(self._handle.stats.remote().result(timeout_s=5))
            except Exception:  # a reading lost under load is a sample fewer
                pass


def stage_cpu(spent_s: dict[str, float], wall_s: float, loops: dict[str, dict[str, dict]]) -> dict[str, float]:
    """Each stage's processes' CPU over a rate (`spent_s`: CPU seconds by `host_cost` role, the client's
    under "client") in cores, and per second its loops were busy (every replica's steps summed): what a
    busy replica costs the shared cores beyond its engine thread (its event loop, Ray's threads). `loops`:
    {"llm" / "detok": {replica: `LoopShare` as a dict}}."""
    from loadtest.host_cost import DETOK_ROLE, LLM_ROLE

    out = {}
    for stage, role in (("llm", LLM_ROLE), ("detok", DETOK_ROLE)):
        busy_s = sum(share["step_share"] * share["span_s"] for share in loops[stage].values())
        cpu_s = spent_s.get(role, 0.0)
        out[f"{stage}_cores"] = round(cpu_s / wall_s, 3)
        out[f"{stage}_cpu_per_busy_s"] = round(cpu_s / busy_s, 3) if busy_s > 0 else 0.0
    rest_s = sum(v for role, v in spent_s.items() if role not in (LLM_ROLE, DETOK_ROLE))
    out["other_cores"] = round(rest_s / wall_s, 3)  # the Router, proxy, Ray's daemons and this client
    return out


def cpu_by_role_s(server_pid: int) -> dict[str, float]:
    """CPU seconds so far of the server's processes by role, and this client's under "client"."""
    from loadtest.host_cost import client_cpu_s, cpu_seconds_by_role

    return {**cpu_seconds_by_role(server_pid), "client": client_cpu_s()}


def read_traces(since_s: float, app_name: str = "voxray", calls: int = READ_CALLS) -> dict[str, dict[str, dict]]:
    """Every replica's loop trace from `since_s` on, per stage: {stage: {replica: trace}} (call inside
    `join_cluster`). A handle's call reaches one replica of its choosing, so each stage is asked `calls`
    times and every replica that answered is kept."""
    from ray import serve

    traces: dict[str, dict[str, dict]] = {}
    for stage in ("LLMStage", "DetokStage"):
        handle = serve.get_deployment_handle(stage, app_name)
        answers = [handle.loop_trace.remote(since_s) for _ in range(calls)]
        traces[stage] = {trace["replica"]: trace for trace in (a.result(timeout_s=60) for a in answers)}
    return traces


def measure(config_name: str, rates: tuple[float, ...], duration_s: float, out: Path, line_ms=None) -> list[dict]:
    """Serve `config_name` (a plan_check configuration), sweep each rate alone and summarize the loops."""
    from loadtest.cluster_process import join_cluster, leave_cluster, running_server
    from loadtest.plan_configs import CONFIGS, serve_config
    from loadtest.plan_served import BoxCpu
    from loadtest.sweep import SweepConfig, run_sweep, wait_ready

    config = next(c for c in CONFIGS if c.name == config_name)
    rows = []
    with running_server(serve_config(config, 19320, 19321), out / config_name) as server:
        wait_ready(server.grpc_target, "voxray")
        join_cluster(server)
        try:
            for index, rate in enumerate(rates):  # in the order given: a rate may repeat (does the server age?)
                cfg = SweepConfig(rates_rps=(rate,), duration_s=duration_s, max_requests=int(duration_s * rate) + 8)
                box_before, cpu_before = BoxCpu.read(server.proc.pid), cpu_by_role_s(server.proc.pid)
                start_s = time.monotonic()
                with LoadSampler() as sampler:
                    result = run_sweep(server.grpc_target, cfg, label=f"{config_name}@{rate}")
                end_s = time.monotonic()
                cpu_after = cpu_by_role_s(server.proc.pid)
                steal_cores = BoxCpu.read(server.proc.pid).steal_cores_since(box_before)
                traces = read_traces(start_s)
                row = {
                    "rate_rps": rate, "summary": result.steps[0]["summary"], "steal_cores": round(steal_cores, 3),
                    "llm": {replica: asdict(loop_share(trace, start_s, end_s, line_ms))
                            for replica, trace in sorted(traces["LLMStage"].items())},
                    "detok": {replica: asdict(loop_share(trace, start_s, end_s))
                              for replica, trace in sorted(traces["DetokStage"].items())},
                    "admission": asdict(admission_share(sampler.loads)),
                    "streams": result.steps[0]["requests"],  # every stream's chunk arrivals, for a later look
                }  # fmt: skip
                spent_s = {role: cpu_after[role] - cpu_before.get(role, 0.0) for role in cpu_after}
                rows.append(row | {"cpu": stage_cpu(spent_s, end_s - start_s, row)})
                (out / f"trace-{index}-{rate}.json").write_text(json.dumps(traces))
                print(report_rate(rows[-1]), flush=True)
        finally:
            leave_cluster()
    return rows


def report_rate(row: dict) -> str:
    summary = row["summary"]
    lines = [f"rate {row['rate_rps']} req/s: p90 TTFA {summary.get('ttfa_p90_s')} s, viable "
             f"{summary.get('pct_viable')}%, stream speed p50 {summary.get('stream_speed_p50_x')}x, "
             f"stolen cores {row.get('steal_cores', 0.0):.2f}"]  # fmt: skip
    cpu = row.get("cpu")
    if cpu:
        lines.append(f"  cpu: llm {cpu['llm_cores']:.2f} cores ({cpu['llm_cpu_per_busy_s']:.2f} a busy loop second), "
                     f"detok {cpu['detok_cores']:.2f} ({cpu['detok_cpu_per_busy_s']:.2f}), "
                     f"the rest {cpu['other_cores']:.2f}")  # fmt: skip
    a = row["admission"]
    detok_limit = "-" if a["mean_detok_limit"] is None else f"{a['mean_detok_limit']:.1f}"
    lines.append(f"  admission ({a['samples']} samples): full {100 * a['full']:.0f}% (detok cap "
                 f"{100 * a['full_by_detok']:.0f}%, pace or slots {100 * a['full_by_pace']:.0f}%, starving "
                 f"{100 * a['full_by_starving']:.0f}%), starts full {100 * a['starts_full']:.0f}%; mean limit "
                 f"{a['mean_limit']:.1f}, detok cap {detok_limit}, open {a['mean_active']:.1f}, paced by "
                 f"{a.get('mean_measured_rows', 0.0):.1f} rows keeping {a.get('mean_real_time_streams', 0.0):.1f} "
                 f"streams at real time")  # fmt: skip
    late = late_streams(row.get("streams", []))
    for stream in late[:LATE_SHOWN]:
        lines.append(f"  late: sent at {stream.sent_s:.2f} s, first audio {stream.ttfa_s:.2f} s, behind from chunk "
                     f"{stream.first_late} ({stream.late_chunks} late, worst {stream.worst_s:.3f} s), chunks so far "
                     f"{list(stream.played_s)} s")  # fmt: skip
    loops = [(stage, replica.split("#")[-1], s) for stage in ("llm", "detok") for replica, s in row[stage].items()]
    for stage, replica, s in loops:
        lines.append(
            f"  {stage} {replica}: steps {100 * s['step_share']:.0f}% gaps {100 * s['gap_share']:.1f}% of "
            f"{s['span_s']} s; "
            f"stalls {s['stalls_per_s']:.2f}/s ({100 * s['stall_excess_share']:.1f}% past the median; longest "
            f"{[float(x) for x in s['stall_excess_ms'][:5]]} ms); "
            f"gc {s['gc_pauses_per_s']:.1f}/s {100 * s['gc_share']:.2f}% longest {s['gc_longest_ms']:.1f} ms"
        )
        for size in s["by_size"]:
            if size["count"] < 20:
                continue
            line = f" line {size['line_ms']:.2f}" if size["line_ms"] is not None else ""
            lines.append(f"    size {size['size']}: n {size['count']} median {size['median_ms']:.2f} mean "
                         f"{size['mean_ms']:.2f} p99 {size['p99_ms']:.2f} cycle {size['mean_cycle_ms']:.2f} ms"
                         f"{line}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/loop_stalls"))
    parser.add_argument("--config", default="cpu-1x1", help="a loadtest.plan_check configuration")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.1, 1.4, 1.8])
    parser.add_argument("--duration-s", type=float, default=45.0, help="seconds of arrivals per rate")
    parser.add_argument("--calibration", type=Path, default=None, help="compare steps with its serving-loop line")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    line_ms = calibration_line(args.calibration) if args.calibration else None
    rows = measure(args.config, tuple(args.rates), args.duration_s, args.out, line_ms)
    (args.out / "loop_stalls.json").write_text(json.dumps(rows, indent=2))
    print(f"files in {args.out}")


if __name__ == "__main__":
    main()

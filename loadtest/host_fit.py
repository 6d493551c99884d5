"""The host cost's fits: what `loadtest.host_cost` measured on a served cluster (c=1 sets, closed-loop
levels, idle spells), turned into the planner calibration's `host` and `host_range` sections
(`cluster.planner.calibration.HostCost`, `HostRange`). Pure functions over the measurement's records,
so they are tested without a cluster; the measuring stays in `loadtest.host_cost`.

- the idle background: the spells' mean, split into a fixed part and a part per stage replica where more
  than one cluster size was measured idle (`background_split`);
- a stream's start and a chunk's CPU beside the engines: fitted over the closed-loop levels
  (`split_host_at_load`, all rounds: `central_split`; each round alone: `split_host_by_round`), or from the
  two c=1 sets where there are no levels (`split_host`);
- the spread: the cheapest and the dearest host the spells and rounds measured (`calibration_host_range`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class SetCost:
    """One set of prompts sent one at a time: totals and the CPU seconds of each group of processes."""

    name: str
    streams: int
    chunks: int
    tokens: int
    wall_s: float
    llm_cpu_s: float
    detok_cpu_s: float
    host_cpu_s: float  # every other process of the tree and the client, HostCost.background_cores subtracted
    ttfa_p50_s: float
    cpu_s_by_role: dict[str, float]  # every process group's CPU seconds over the set (client: this process)
    windows: tuple[int, ...]  # frames the detokenizer decoded for each chunk (kept + its context)

    @property
    def chunks_per_stream(self) -> float:
        return self.chunks / self.streams

    @property
    def host_ms_per_stream(self) -> float:
        return 1e3 * self.host_cpu_s / self.streams


@dataclass(frozen=True)
class HostCost:
    """One served calibration's measurements (`measure`); `calibration_host` / `calibration_host_range` fit
    the calibration's sections from them. The fields with defaults may be absent from older host_cost.json files."""

    background_cores: float  # CPU seconds a second the idle server's processes take: the spells' mean
    host_ms_per_stream: float  # a stream's start and end beside the engines (Router, proxy, Ray, client)
    host_ms_per_chunk: float  # each chunk's trip beside the engines
    llm_ms_per_token: float  # the LLM replica's CPU per token at one row (engine step + serving loop)
    detok_ms_per_chunk: float  # the detok replica's CPU per chunk decoded alone
    ttfa_p50_s: float  # c=1, the short set's
    sets: tuple[SetCost, ...]
    detok_windows: tuple[int, ...]  # every chunk's window frames, both sets
    # the LLM replica's serving-loop step (ms) by batch rows under closed-loop load: each size's mean cycle
    loaded_step_ms_by_rows: dict[int, float]
    saturated: SaturatedLoad | None = None  # the last closed-loop level's chunks and host CPU (None: not read)
    levels: tuple[SaturatedLoad, ...] = ()  # every closed-loop level, the last one included
    # idle cores by the served cluster's stage replicas (LLM + detok): the 1x1 here, more where measured
    background_by_replicas: dict[int, float] = field(default_factory=dict)
    # every idle spell's cores, in order (the mean is `background_cores`: the background is a rate, and the
    # periodic upkeep (Ray's metrics, GCS heartbeats) one spell caught the served streams pay too)
    background_samples: tuple[float, ...] = ()
    # the same cycles' spread, in spells and steps within them (`loop_stalls.cycle_spread`; None: not read)
    loaded_step_spread: dict | None = None


@dataclass(frozen=True)
class SaturatedLoad:
    """One closed-loop level: clients at once, what it served and the host's CPU over it (the background
    subtracted; the LLM and detok replicas' CPU apart)."""

    clients: int
    wall_s: float
    streams: int
    chunks: int
    host_cpu_s: float
    llm_cpu_s: float
    detok_cpu_s: float
    round: int = 0  # which run of the level sequence (0: the first; files from before the repeats: all 0)

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.wall_s


def saturated_host_ms_per_chunk(load: SaturatedLoad, host_ms_per_stream: float) -> float:
    """The host's CPU per chunk at load: its CPU over the level less `host_ms_per_stream` (c=1) a stream
    served, over the chunks served; never below 0."""
    if load.chunks <= 0:
        return 0.0
    return max(0.0, (1e3 * load.host_cpu_s - host_ms_per_stream * load.streams) / load.chunks)


def background_split(by_replicas: dict[int, float]) -> tuple[float, float]:
    """(fixed cores, cores per stage replica): the line through the idle background measured at two or more
    cluster sizes (least squares; per replica never below 0); one size: all of it fixed."""
    import numpy as np

    if len(by_replicas) < 2:
        return (next(iter(by_replicas.values()), 0.0), 0.0)
    replicas = np.asarray(list(by_replicas), np.float64)
    cores = np.asarray(list(by_replicas.values()), np.float64)
    slope, intercept = np.polyfit(replicas, cores, 1)
    if slope <= 0:
        return float(cores.mean()), 0.0
    if intercept < 0:  # all of it by replica
        return 0.0, float(cores @ replicas / (replicas @ replicas))
    return float(intercept), float(slope)


def less_background(sets: tuple[SetCost, ...], loads: tuple[SaturatedLoad, ...], background: float,
                    ) -> tuple[tuple[SetCost, ...], tuple[SaturatedLoad, ...]]:  # fmt: skip
    """The sets and levels with `background` cores x their wall seconds taken off their host CPU (a
    level's never below 0): one background for all of them, the spells' mean, known once all are read."""
    sets = tuple(replace(s, host_cpu_s=s.host_cpu_s - background * s.wall_s) for s in sets)
    loads = tuple(replace(lv, host_cpu_s=max(0.0, lv.host_cpu_s - background * lv.wall_s)) for lv in loads)
    return sets, loads


def split_host_by_round(levels: tuple[SaturatedLoad, ...]) -> dict[int, tuple[float, float]]:
    """Each round's own (ms per stream, ms per chunk) fit (`split_host_at_load` over its levels), by round;
    a round of fewer than two levels has none."""
    rounds = sorted({lv.round for lv in levels})
    fits = {index: split_host_at_load(tuple(lv for lv in levels if lv.round == index)) for index in rounds}
    return {index: fit for index, fit in fits.items() if fit is not None}


def split_host_at_load(levels: tuple[SaturatedLoad, ...]) -> tuple[float, float] | None:
    """(ms per stream, ms per chunk): the least-squares fit of host CPU = a x streams + b x chunks over the
    closed-loop levels (none negative), or None with fewer than two levels. At load, not from the difference
    of the two c=1 sums (which gave 0 ms a stream on 2026-12-06, and the 2x2's host work came out 3-4x short)."""
    import numpy as np

    if len(levels) < 2:
        return None
    a = np.asarray([[lv.streams, lv.chunks] for lv in levels], np.float64)
    b = np.asarray([lv.host_cpu_s for lv in levels], np.float64)
    per_stream_s, per_chunk_s = np.linalg.lstsq(a, b, rcond=None)[0]
    if per_stream_s < 0 or per_chunk_s < 0:  # one term alone, the one that fits better
        fits = [(float(np.sum((b - a[:, k] * c) ** 2)), k, c)
                for k in (0, 1) for c in [max(0.0, float(a[:, k] @ b / max(a[:, k] @ a[:, k], 1e-12)))]]  # fmt: skip
        _, k, c = min(fits)
        per_stream_s, per_chunk_s = (c, 0.0) if k == 0 else (0.0, c)
    return 1e3 * float(per_stream_s), 1e3 * float(per_chunk_s)


def split_host(short: SetCost, long: SetCost) -> tuple[float, float]:
    """(ms per stream, ms per chunk) solving the two sets' host CPU per stream = a + b x chunks per stream;
    with too little spread in chunks, all of it per chunk."""
    spread = long.chunks_per_stream - short.chunks_per_stream
    per_chunk = (long.host_ms_per_stream - short.host_ms_per_stream) / spread if spread > 0.5 else 0.0
    if spread <= 0.5 or per_chunk < 0:
        total = short.host_cpu_s + long.host_cpu_s
        return 0.0, 1e3 * total / (short.chunks + long.chunks)
    per_stream = short.host_ms_per_stream - per_chunk * short.chunks_per_stream
    if per_stream < 0:  # all of it scales with chunks
        return 0.0, 1e3 * (short.host_cpu_s + long.host_cpu_s) / (short.chunks + long.chunks)
    return per_stream, per_chunk


def host_cost_of(raw_sets: tuple[SetCost, SetCost], raw_loads: tuple[SaturatedLoad, ...], steps: dict[int, float],
                 samples: tuple[float, ...], stage_replicas: int,
                 step_spread: dict | None = None) -> HostCost:  # fmt: skip
    """The measurement from what the served cluster gave (the sets' and levels' host CPU with the background
    still in; `samples`: every idle spell's cores): the background is the spells' mean, taken off them all."""
    background = statistics.fmean(samples)
    sets, loads = less_background(raw_sets, raw_loads, background)
    short, long = sets
    per_stream, per_chunk = split_host(short, long)
    return HostCost(
        background_cores=background, host_ms_per_stream=per_stream, host_ms_per_chunk=per_chunk,
        llm_ms_per_token=1e3 * sum(s.llm_cpu_s for s in sets) / sum(s.tokens for s in sets),
        detok_ms_per_chunk=1e3 * sum(s.detok_cpu_s for s in sets) / sum(s.chunks for s in sets),
        ttfa_p50_s=short.ttfa_p50_s, sets=sets, loaded_step_ms_by_rows=steps,
        detok_windows=short.windows + long.windows, saturated=loads[-1] if loads else None, levels=loads,
        background_by_replicas={stage_replicas: background}, background_samples=samples,
        loaded_step_spread=step_spread,
    )  # fmt: skip


def central_split(cost: HostCost) -> tuple[float, float]:
    """(ms per stream, ms per chunk) of the calibration's `host`: fitted together over every closed-loop
    level, all rounds (`split_host_at_load`: many streams and chunks, where the difference of the two c=1
    sums is noise); with one level, a chunk's from the saturated level less the c=1 start cost; with none,
    both from the c=1 sets."""
    at_load = split_host_at_load(cost.levels)
    if at_load is not None:
        return at_load
    if cost.saturated is not None and cost.saturated.chunks > 0:
        return cost.host_ms_per_stream, saturated_host_ms_per_chunk(cost.saturated, cost.host_ms_per_stream)
    return cost.host_ms_per_stream, cost.host_ms_per_chunk


def background_line(cost: HostCost) -> tuple[float, float]:
    """(fixed cores, cores per stage replica) of the idle background (`background_split`)."""
    return background_split(cost.background_by_replicas or {2: cost.background_cores})


def host_section(cores: int, background: tuple[float, float], split: tuple[float, float]) -> dict:
    """One calibration `host` section from (fixed, per-replica) idle cores and (ms per stream, ms per chunk)."""
    (fixed, per_replica), (per_stream, per_chunk) = background, split
    return {
        "cores": cores, "background_cores": round(fixed, 4), "background_cores_per_replica": round(per_replica, 4),
        "cpu_ms_per_stream": round(per_stream, 3), "cpu_ms_per_chunk": round(per_chunk, 3),
    }  # fmt: skip


def calibration_host(cost: HostCost, cores: int) -> dict:
    """The calibration's `host` section from a measurement (see `cluster.planner.calibration.HostCost`): a
    start's and a chunk's CPU as `central_split` fits them, and the idle background (the spells' mean) split
    into a fixed part and a part per stage replica (`background_split`) where more than one cluster size was
    measured idle."""
    return host_section(cores, background_line(cost), central_split(cost))


def typical_chunks_per_stream(cost: HostCost) -> float:
    """Chunks a stream in the c=1 sets (both together): the stream a fit's cost is judged by; without sets,
    the closed-loop levels'; without either, 0."""
    for group in (cost.sets, cost.levels):
        streams = sum(item.streams for item in group)
        if streams > 0:
            return sum(item.chunks for item in group) / streams
    return 0.0


def calibration_host_range(cost: HostCost, cores: int) -> dict | None:
    """The calibration's `host_range`: {"low": the cheapest host measured, "high": the dearest}, each a
    complete `host` section; None where nothing spread (one idle spell and fewer than two rounds' fits).

    - a stream's and a chunk's CPU: of the whole-calibration fit (`central_split`, the `host` section's)
      and each round's own (`split_host_by_round`), "low" takes the one whose typical stream costs the
      host least and "high" the most: cpu_ms_per_stream + cpu_ms_per_chunk x the c=1 sets' chunks a stream
      (`typical_chunks_per_stream`; the two terms alone are ill-conditioned, nearly collinear over the
      levels, their sum at a typical stream is not);
    - the idle background: the `host` section's line (fixed and per replica) scaled by the lowest idle
      spell / the spells' mean for "low", by the highest / the mean for "high" (at the measured 1x1: that
      spell's cores).
    Both choices take the extremes of candidates that include the central one, so `host` lies between the
    two on both counts. A cheaper host leaves the stages more cores: "low" gives the higher capacity."""
    by_round = split_host_by_round(cost.levels)
    samples = cost.background_samples
    if len(by_round) < 2 and len(samples) < 2:
        return None
    chunks = typical_chunks_per_stream(cost)
    fits = [central_split(cost), *by_round.values()]
    cheapest = min(fits, key=lambda fit: fit[0] + fit[1] * chunks)
    dearest = max(fits, key=lambda fit: fit[0] + fit[1] * chunks)
    line, mean = background_line(cost), cost.background_cores
    low_scale, high_scale = (min(samples) / mean, max(samples) / mean) if samples and mean > 0 else (1.0, 1.0)
    return {"low": host_section(cores, _scaled(line, low_scale), cheapest),
            "high": host_section(cores, _scaled(line, high_scale), dearest)}  # fmt: skip


def _scaled(line: tuple[float, float], factor: float) -> tuple[float, float]:
    return line[0] * factor, line[1] * factor


def report(cost: HostCost) -> str:
    lines = ["| set | streams | chunks / stream | LLM ms / token | detok ms / chunk | host ms / stream | TTFA p50 s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in cost.sets:
        per_token, per_chunk = 1e3 * s.llm_cpu_s / s.tokens, 1e3 * s.detok_cpu_s / s.chunks
        lines.append(f"| {s.name} | {s.streams} | {s.chunks_per_stream:.1f} | {per_token:.2f} | {per_chunk:.2f} | "
                     f"{s.host_ms_per_stream:.1f} | {s.ttfa_p50_s:.3f} |")  # fmt: skip
    steps = ", ".join(f"{rows}: {ms:.2f}" for rows, ms in cost.loaded_step_ms_by_rows.items())
    lines.append(f"serving-loop step ms by rows under load: {steps}")
    if cost.loaded_step_spread:
        spells, steps = cost.loaded_step_spread["spells"], cost.loaded_step_spread["steps"]
        lines.append(f"their spread over each size's mean: {cost.loaded_step_spread['spell_s']} s spells "
                     f"{spells[0]:.2f}-{spells[-1]:.2f}, steps within them {steps[0]:.2f}-{steps[-1]:.2f} "
                     f"(median {statistics.median(steps):.3f})")  # fmt: skip
    spells = ", ".join(f"{cores:.3f}" for cores in cost.background_samples)
    lines.append(f"background {cost.background_cores:.3f} cores (idle spells: {spells or '-'}); host "
                 f"{cost.host_ms_per_stream:.1f} ms a stream + {cost.host_ms_per_chunk:.2f} ms a chunk "
                 f"(c=1)")  # fmt: skip
    if cost.saturated is not None:
        sat = cost.saturated
        per_chunk = saturated_host_ms_per_chunk(sat, cost.host_ms_per_stream)
        lines.append(f"saturated ({sat.clients} clients, {sat.wall_s:.1f} s): {sat.streams} streams, "
                     f"{sat.chunks_per_s:.1f} chunks/s, host {sat.host_cpu_s:.2f} CPU s = {per_chunk:.2f} ms a chunk; "
                     f"LLM {sat.llm_cpu_s:.2f}, detok {sat.detok_cpu_s:.2f} CPU s")  # fmt: skip
    at_load = split_host_at_load(cost.levels)
    if at_load is not None:  # what the calibration uses
        levels = ", ".join(f"{lv.clients} (round {lv.round}): {lv.host_cpu_s:.2f} CPU s / {lv.streams} streams / "
                           f"{lv.chunks} chunks" for lv in cost.levels)  # fmt: skip
        lines.append(f"host at load (closed-loop levels {levels}): {at_load[0]:.1f} ms a stream + "
                     f"{at_load[1]:.2f} ms a chunk")  # fmt: skip
    by_round = split_host_by_round(cost.levels)
    if len(by_round) > 1:  # the spread `host_range` spans
        fits = "; ".join(f"round {index}: {a:.1f} ms a stream + {b:.2f} ms a chunk"
                         for index, (a, b) in by_round.items())  # fmt: skip
        lines.append(f"host at load by round: {fits}")
    return "\n".join(lines)

"""Size a cluster for N concurrent streams at an SLO, and sweep N to see where the bottleneck moves.

`size_cluster` finds the fewest LLM replicas that meet the SLO with an unlimited detokenizer, searching on a
slice of at most `slice_replicas` replicas carrying their share of the streams (replicas are alike and the
router spreads streams evenly, so a slice at the same load per replica behaves like the whole), then runs the
LLM pass once at full size and finds the fewest detok replicas over those same chunks; if the full run
misses, one more LLM replica, up to `max_retries`. One LLM or detok replica = one GPU (none shared).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from cluster.planner import simulate
from cluster.planner.predict import LLMRun, Scenario, finish, first_chunk_s, predict, run_llm
from cluster.planner.simulate import ClusterShape, Prediction, SimOptions
from cluster.planner.workload import draw_spans_s
from core.config import AdmissionConfig
from core.errors import InvalidArgumentError

DEFAULT_MAX_STARTING = AdmissionConfig().max_starting_per_replica


@dataclass(frozen=True)
class Slo:
    ttfa_p90_s: float
    min_viable_pct: float = 99.0


@dataclass(frozen=True)
class Plan:
    streams: int
    llm_replicas: int
    detok_replicas: int
    prediction: Prediction

    @property
    def gpus(self) -> int:
        return self.llm_replicas + self.detok_replicas

    @property
    def streams_per_gpu(self) -> float:
        return self.streams / self.gpus


@dataclass(frozen=True)
class SearchOptions:
    slice_replicas: int = 8
    max_retries: int = 3
    extra_llm_shares: tuple[float, ...] = (0.05, 0.15)  # also size detok with this share more LLM replicas
    sim: SimOptions = SimOptions()
    max_starting_per_replica: int = DEFAULT_MAX_STARTING  # admission's start limit (0: none)


def zero_load_ttfa_s(scenario: Scenario, options: SimOptions = SimOptions()) -> float:
    """The first chunk's compute for the workload's shortest text, alone on the cluster."""
    chars = np.asarray([min(scenario.workload.text_chars)], np.float64)
    frames = int(scenario.workload.frames_for(chars, scenario.rates)[0])
    prompt = math.ceil(chars[0] / scenario.workload.chars_per_prompt_token) + scenario.workload.prompt_overhead_tokens
    return first_chunk_s(scenario, prompt, frames, options)


def real_time_rows(scenario: Scenario, options: SimOptions = SimOptions()) -> int:
    """The most rows whose step keeps real time (the LLM's throughput bound per replica), within the slots."""
    calib, rates = scenario.calib, scenario.rates
    cache = float(scenario.workload.max_frames_needed(rates) * rates.tokens_per_frame) / 2
    return simulate.real_time_rows(calib, rates, calib.max_streams_per_replica, cache, options.step_scale)


def size_cluster(scenario: Scenario, streams: int, slo: Slo, options: SearchOptions = SearchOptions()) -> Plan:
    """The fewest GPUs for `streams` concurrent streams at `slo`: the fewest LLM replicas, then the fewest
    detok replicas for them; more LLM headroom leaves TTFA slack that can save detok replicas, so
    `extra_llm_shares` more LLM replicas are tried too and the plan with the fewest GPUs kept."""
    check_reachable(scenario, slo, options.sim)
    llm_replicas = fewest_llm_replicas(scenario, streams, slo, options) - 1
    for _ in range(options.max_retries + 1):
        llm_replicas += 1
        run = run_llm(scenario, streams, _shape(scenario, llm_replicas, 0, options), options.sim)
        plan = _fewest_detok_replicas(scenario, run, streams, llm_replicas, slo, options.sim)
        if plan is not None:
            return _with_more_llm(scenario, streams, slo, options, plan)
    most_detok = 2 * llm_replicas
    return Plan(streams, llm_replicas, most_detok, finish(scenario, run, most_detok, options.sim))  # misses the SLO


def _with_more_llm(scenario: Scenario, streams: int, slo: Slo, options: SearchOptions, plan: Plan) -> Plan:
    best = plan
    for share in options.extra_llm_shares:
        extra = max(1, math.ceil(share * plan.llm_replicas))
        if extra >= best.detok_replicas - 1:  # a detok replica stays: no GPU to save
            break
        llm_replicas = plan.llm_replicas + extra
        run = run_llm(scenario, streams, _shape(scenario, llm_replicas, 0, options), options.sim)
        other = _fewest_detok_replicas(scenario, run, streams, llm_replicas, slo, options.sim)
        if other is not None and other.gpus < best.gpus:
            best = other
    return best


def check_reachable(scenario: Scenario, slo: Slo, options: SimOptions = SimOptions()) -> None:
    floor_s = zero_load_ttfa_s(scenario, options)
    if slo.ttfa_p90_s <= floor_s:
        raise InvalidArgumentError(
            "ttfa_p90_s", f"{slo.ttfa_p90_s} s is under the zero-load TTFA of {scenario.calib.model} on "
            f"{scenario.calib.gpu} ({floor_s:.3f} s: the first chunk's compute); no replica count meets it",
        )  # fmt: skip


def fewest_llm_replicas(scenario: Scenario, streams: int, slo: Slo, options: SearchOptions) -> int:
    """Binary search from the throughput bound (streams / real-time rows) on slices, detok unlimited."""
    low = max(1, math.ceil(streams / real_time_rows(scenario, options.sim)))
    if _llm_meets(scenario, streams, low, slo, options):
        return low
    high = low * 2
    while not _llm_meets(scenario, streams, high, slo, options):
        if high >= streams:
            return streams
        low, high = high, min(streams, high * 2)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if _llm_meets(scenario, streams, middle, slo, options) else (middle, high)
    return high


def _llm_meets(scenario: Scenario, streams: int, replicas: int, slo: Slo, options: SearchOptions) -> bool:
    part = min(replicas, options.slice_replicas)
    return meets_slo(scenario, streams * part / replicas, _shape(scenario, part, 0, options), slo, options.sim)


def majority_meets(verdicts: list[bool], draws: int) -> bool | None:
    """True / False once most of `draws` Poisson draws met / missed the SLO; None while undecided (the
    planner's loads here, `loadtest.plan_check`'s swept rates on the real cluster)."""
    need = draws // 2 + 1
    if sum(verdicts) >= need:
        return True
    if len(verdicts) - sum(verdicts) > draws - need:
        return False
    return None


# `SimOptions.seeds` 0: as many draws per load as hold AUTO_ARRIVALS arrivals together (odd, at most MAX_AUTO_DRAWS).
# A few replicas see ~200 arrivals in a 90 s draw, and whether its bursts land near capacity swings the capacity
# a draw calls by +-30% (cpu-1x1 on run k's calibration: 1.87 at 1 draw, 2.56 at 3, 2.14 at 12); a fleet's slice
# sees thousands, where one draw is the load.
AUTO_ARRIVALS = 2000
MAX_AUTO_DRAWS = 13


def draws_for(scenario: Scenario, streams: float, sim: SimOptions) -> int:
    """Poisson draws that decide a load of `streams`: `sim.seeds`, or for 0 enough for AUTO_ARRIVALS arrivals."""
    if sim.seeds > 0:
        return sim.seeds
    workload, rates = scenario.workload, scenario.rates
    _, measure_s, _ = draw_spans_s(streams, workload, rates, sim.min_measured, sim.draw_s)
    per_draw = streams / workload.mean_audio_s(rates) * measure_s  # arrivals measured in one draw
    draws = math.ceil(AUTO_ARRIVALS / max(per_draw, 1.0))
    return min(draws + (draws % 2 == 0), MAX_AUTO_DRAWS)


def meets_slo(scenario: Scenario, streams: float, shape: ClusterShape, slo: Slo, sim: SimOptions) -> bool:
    """Whether `shape` meets `slo` at `streams` concurrent streams in most of its Poisson draws (`draws_for`;
    seeds `sim.seed`, `sim.seed + 1`, ...; stops once the majority is decided). One draw is one sweep's
    worth of arrivals: whether its few bursts land near capacity decides its p90, not the load."""
    draws = draws_for(scenario, streams, sim)
    met, _ = decide_by_draws(draws, slo, lambda index: predict(scenario, streams, shape, seeded(sim, index)))
    return met


def decide_by_draws(draws: int, slo: Slo, predict_draw: Callable[[int], Prediction]) -> tuple[bool, list[Prediction]]:
    """Whether most of `draws` draws meet `slo`, running draw 0, 1, ... (`predict_draw(index)`) only until the
    majority is decided (`majority_meets`); with the predictions run."""
    predictions: list[Prediction] = []
    verdicts: list[bool] = []
    while (met := majority_meets(verdicts, draws)) is None:
        predictions.append(predict_draw(len(predictions)))
        verdicts.append(predictions[-1].meets(slo.ttfa_p90_s, slo.min_viable_pct))
    return met, predictions


def seeded(sim: SimOptions, index: int) -> SimOptions:
    """The options of a load's `index`-th draw: seed `sim.seed + index`."""
    return replace(sim, seed=sim.seed + index)


def _fewest_detok_replicas(scenario: Scenario, run: LLMRun, streams: int, llm_replicas: int, slo: Slo,
                           sim: SimOptions) -> Plan | None:  # fmt: skip
    """Over one LLM run's chunks: the fewest detok replicas meeting `slo`, None if even two per LLM replica
    miss (then the LLM side needs more)."""

    def attempt(replicas: int) -> Prediction:
        return finish(scenario, run, replicas, sim)

    high = 2 * llm_replicas
    best = attempt(high)
    if not best.meets(slo.ttfa_p90_s, slo.min_viable_pct):
        return None
    low = 0  # zero replicas never serve
    while high - low > 1:
        middle = (low + high) // 2
        prediction = attempt(middle)
        if prediction.meets(slo.ttfa_p90_s, slo.min_viable_pct):
            high, best = middle, prediction
        else:
            low = middle
    return Plan(streams, llm_replicas, high, best)


def capacity_streams(scenario: Scenario, shape: ClusterShape, slo: Slo, high: float, sim: SimOptions = SimOptions(),
                     tolerance: float = 0.05, min_step: float = 0.1) -> float:  # fmt: skip
    """The most concurrent streams (offered load: arrivals x mean audio seconds) `shape` carries at `slo` (in
    most of `sim.seeds` draws): bisection below `high` to within `tolerance` of it or `min_step` streams,
    whichever is wider (0 if none of the loads tried meets it). Not whole streams: a 1x1 on the CPU preset
    carries ~5, where one stream more or less is 20% of its capacity."""
    low = 0.0
    while high - low > max(min_step, tolerance * low):
        middle = (low + high) / 2
        if meets_slo(scenario, middle, shape, slo, sim):
            low = middle
        else:
            high = middle
    return low


def sweep(scenario: Scenario, loads: list[int], slo: Slo, options: SearchOptions = SearchOptions()) -> list[Plan]:
    return [size_cluster(scenario, streams, slo, options) for streams in loads]


def _shape(scenario: Scenario, llm_replicas: int, detok_replicas: int, options: SearchOptions) -> ClusterShape:
    return ClusterShape(llm_replicas, detok_replicas, scenario.calib.max_streams_per_replica,
                        options.max_starting_per_replica)  # fmt: skip

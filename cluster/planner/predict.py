"""One configuration's prediction: the LLM pass, the detokenizer pass, then DESIGN §1's playback metrics.

`predict` runs `simulate.run_llm_stage` for the chunks' cut times, prices the detok replicas' batches over
those arrivals (FIFO per replica, a stream's chunks on one replica), adds the hops, and scores every stream
that arrived in the measurement window: TTFA, on-time chunks, viability, refusals. `first_chunk_s` is the
zero-load floor (the first chunk's compute alone). Called by `cluster.planner.search` and `voxray plan`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import numpy as np

from cluster.planner.calibration import Calibration, HostCost
from cluster.planner.shared_cores import CoreShare
from cluster.planner.simulate import ClusterShape, LLMPass, Prediction, SimOptions, run_llm_stage
from cluster.planner.workload import ChunkRule, ModelRates, Streams, Workload, make_streams


@dataclass(frozen=True)
class Scenario:
    """What is asked of the cluster: a model's calibration, its audio clock and the clients' texts."""

    calib: Calibration
    rates: ModelRates
    workload: Workload = Workload()

    def chunk_rule(self) -> ChunkRule:
        return ChunkRule.from_spec(self.calib.schedule)

    def with_host(self, host: HostCost) -> Scenario:
        """This scenario on another host (e.g. an end of the calibration's `host_range`), all else alike."""
        return replace(self, calib=replace(self.calib, host=host))


@dataclass(frozen=True)
class LLMRun:
    """The LLM pass of one run, kept so the detokenizer stage can be re-sized over the same chunks."""

    streams: Streams
    llm: LLMPass
    window_s: tuple[float, float]
    share: CoreShare | None = None  # the host's cores as the LLM pass left them (None: not shared)
    llm_replicas: int = 1


def predict(scenario: Scenario, streams_in_flight: float, shape: ClusterShape,
            options: SimOptions = SimOptions()) -> Prediction:  # fmt: skip
    """Simulate `streams_in_flight` concurrent streams (on average) on `shape`."""
    run = run_llm(scenario, streams_in_flight, shape, options)
    return finish(scenario, run, shape.detok_replicas, options)


def run_llm(scenario: Scenario, streams_in_flight: float, shape: ClusterShape, options: SimOptions) -> LLMRun:
    """The LLM pass, `options.passes` times: each later pass holds slots and starts for the delivery times
    the detok stage (`shape.detok_replicas`) and hops gave the pass before, and, where the stages share the
    host's cores, steps at the speed the pass before's detok work and host work left it."""
    streams = make_streams(streams_in_flight, scenario.workload, scenario.rates, options.seed, options.min_measured,
                           options.draw_s)  # fmt: skip
    return run_llm_on(scenario, streams, shape, options)


def run_llm_on(scenario: Scenario, streams: Streams, shape: ClusterShape, options: SimOptions) -> LLMRun:
    """`run_llm` over given `streams` (e.g. a served draw's own arrivals: `loadtest.plan_replay`), measured over
    the span of their measured arrivals."""
    measured_at = streams.arrival_s[streams.is_measured]
    window_s = (float(measured_at.min()), float(measured_at.max()))
    delivery_s, share = None, None
    if scenario.calib.host.cores > 0:
        horizon_s = float(streams.arrival_s[-1]) + 60.0 * float(streams.frames.max()) * scenario.rates.frame_s
        share = CoreShare.empty(scenario.calib.host, horizon_s, shape.llm_replicas + shape.detok_replicas)
    passes = options.passes_for(share is not None)
    for done in range(passes):
        llm = run_llm_stage(streams, shape, scenario.calib, scenario.rates, scenario.chunk_rule(), options, window_s,
                            delivery_s, share)  # fmt: skip
        if share is not None:
            share = share.with_host_work(llm.admitted_s, llm.chunk_cut_s)
            share.llm_busy = llm.llm_busy if llm.llm_busy is not None else np.zeros_like(share.llm_busy)
        run = LLMRun(streams, llm, window_s, share, shape.llm_replicas)
        if done + 1 < passes:
            heard, _ = heard_s(scenario, run, shape.detok_replicas, options)
            delivery_s = stream_delivery_s(streams.count, llm, heard)
    return run


def heard_s(scenario: Scenario, run: LLMRun, detok_replicas: int, options: SimOptions) -> tuple[np.ndarray, float]:
    """When each chunk of `run` reaches its client (the detok pass and both hops), and the detok stage's load;
    with shared cores, the detok pass's busy time is left in `run.share` for the next LLM pass."""
    calib, llm = scenario.calib, run.llm
    arrive_s = llm.chunk_cut_s + calib.llm_to_detok_s
    if run.share is not None:  # the detok stage may be re-sized over one LLM pass: the background follows it
        run.share.stage_replicas = run.llm_replicas + detok_replicas
    done_s, detok_load = detok_stage(arrive_s, llm.chunk_window, llm.chunk_stream, detok_replicas, calib,
                                     options.detok_scale, run.window_s, run.share)  # fmt: skip
    return done_s + calib.detok_to_client_s, detok_load


def stream_delivery_s(count: int, llm: LLMPass, heard: np.ndarray) -> np.ndarray:
    """Per stream, the mean time its chunks took from their cut to the client (0 for one with no chunk)."""
    lag_s = np.bincount(llm.chunk_stream, weights=heard - llm.chunk_cut_s, minlength=count)
    return lag_s / np.maximum(np.bincount(llm.chunk_stream, minlength=count), 1)


def finish(scenario: Scenario, run: LLMRun, detok_replicas: int, options: SimOptions) -> Prediction:
    """The detokenizer pass over `run`'s chunks with `detok_replicas`, the hops, and the playback score."""
    heard, detok_load = heard_s(scenario, run, detok_replicas, options)
    return score(run.streams, run.llm, heard, scenario.rates, detok_load)


def detok_stage(arrive_s: np.ndarray, windows: np.ndarray, stream: np.ndarray, replicas: int, calib: Calibration,
                scale: float, window_s: tuple[float, float], share: CoreShare | None = None,
                ) -> tuple[np.ndarray, float]:  # fmt: skip
    """When each chunk's audio leaves the codec, and the detok stage's load in the window: frames decoded a
    second over what its replicas decode a second in full batches (>= 1: it cannot keep up). With `share`
    (cores shared with the LLM stage and the host), each batch lasts its cost / the share of a core it gets,
    and the batches' busy time is written to `share.detok_busy`."""
    sharing = share is not None and share.enabled
    if replicas == 0:  # unlimited: every chunk decoded alone at once
        return arrive_s + calib.detok.batch_ms(windows) * scale / 1e3, 0.0
    cost_ms = calib.detok.batch_ms(np.arange(int(windows.max(initial=1)) * calib.detok.max_batch_chunks + 1))
    cost_s = (cost_ms * scale / 1e3).tolist()  # by frames in the batch
    order = np.lexsort((arrive_s, stream % replicas))
    bounds = np.searchsorted((stream % replicas)[order], np.arange(replicas + 1))
    done_s = np.empty_like(arrive_s)
    batches: list[tuple[float, float]] = []
    speed = (lambda t: float(share.speed(np.asarray([t]), "detok")[0])) if sharing else None
    for replica in range(replicas):
        mine = order[bounds[replica] : bounds[replica + 1]]
        done_s[mine] = _batch_server(arrive_s[mine].tolist(), windows[mine].tolist(), cost_s,
                                     calib.detok.max_batch_chunks, speed, batches)  # fmt: skip
    if sharing:
        starts, lengths = (np.asarray(v) for v in zip(*batches, strict=True)) if batches else (np.empty(0),) * 2
        share.detok_busy = share.busy_series(starts, lengths)
    in_window = (arrive_s >= window_s[0]) & (arrive_s < window_s[1])
    frames_per_s = float(windows[in_window].sum()) / (window_s[1] - window_s[0]) / replicas
    full_frames = min(len(cost_s) - 1, calib.detok.max_batch_chunks * int(np.median(windows)))
    return done_s, frames_per_s / (full_frames / cost_s[full_frames])


def _batch_server(arrive_s: list[float], windows: list[int], cost_s: list[float], limit: int,
                  speed=None, batches: list[tuple[float, float]] | None = None) -> list[float]:  # fmt: skip
    """One detok replica: whenever free, decode every chunk arrived (oldest first, up to `limit`); a batch
    lasts its cost / `speed(start)` (None: 1). Each batch's (start, length) is appended to `batches`."""
    done_s = [0.0] * len(arrive_s)
    free_s, i, n = 0.0, 0, len(arrive_s)
    while i < n:
        start_s = free_s if free_s > arrive_s[i] else arrive_s[i]
        end = min(bisect.bisect_right(arrive_s, start_s, i), i + limit)
        length_s = cost_s[sum(windows[i:end])]
        if speed is not None:
            length_s /= speed(start_s)
        free_s = start_s + length_s
        if batches is not None:
            batches.append((start_s, length_s))
        done_s[i:end] = [free_s] * (end - i)
        i = end
    return done_s


def first_heard_s(count: int, llm: LLMPass, heard_s: np.ndarray) -> np.ndarray:
    """Per stream, when its first chunk reached its client (inf: none did)."""
    first = np.full(count, np.inf)
    is_first = llm.chunk_seq == 0
    np.minimum.at(first, llm.chunk_stream[is_first], heard_s[is_first])
    return first


def score(streams: Streams, llm: LLMPass, heard_s: np.ndarray, rates: ModelRates, detok_load: float) -> Prediction:
    """DESIGN §1 per measured stream: TTFA (inf if refused or unfinished), viable iff every chunk arrived
    and each arrived before the audio received before it ran out."""
    order = np.lexsort((llm.chunk_seq, llm.chunk_stream))  # by stream, then seq
    stream, heard = llm.chunk_stream[order], heard_s[order]
    starts = np.flatnonzero(np.r_[True, stream[1:] != stream[:-1]]) if len(stream) else np.empty(0, np.int64)
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(stream)]))
    heard = np.maximum.accumulate(heard + group * 1e7) - group * 1e7  # the client plays chunks in order
    kept = llm.chunk_kept[order]
    played_s = kept * rates.frame_s
    received_before = np.cumsum(played_s) - played_s
    received_before -= received_before[starts][group]
    underrun = np.maximum(heard - heard[starts][group] - received_before, 0.0)
    first_s = np.full(streams.count, np.inf)
    first_s[stream[starts]] = heard[starts]
    worst = np.zeros(streams.count)
    np.maximum.at(worst, stream, underrun)
    complete = np.bincount(stream, weights=kept, minlength=streams.count) == streams.frames
    measured = streams.is_measured
    ttfa = (first_s - streams.arrival_s)[measured]
    viable = (complete & (worst <= 1e-9))[measured]
    refused = np.isnan(llm.admitted_s)[measured]
    waited = (llm.admitted_s - streams.arrival_s)[measured]
    return Prediction(
        p50_ttfa_s=percentile(ttfa, 50), p90_ttfa_s=percentile(ttfa, 90),
        viable_pct=100.0 * float(viable.mean()), rejected_pct=100.0 * float(refused.mean()),
        worst_underrun_s=float(worst[measured].max()),
        queue_wait_p90_s=percentile(np.where(refused, np.inf, waited), 90),
        llm_load=llm.llm_load, detok_load=detok_load, slot_use=llm.slot_use, num_measured=int(measured.sum()),
    )  # fmt: skip


def percentile(values: np.ndarray, pct: float) -> float:
    """A percentile that keeps inf (refused or unfinished streams) instead of turning it into nan."""
    return float(np.percentile(values, pct, method="higher"))


def first_chunk_s(scenario: Scenario, prompt_tokens: int, frames: int, options: SimOptions = SimOptions()) -> float:
    """The zero-load TTFA: one stream alone prefills, decodes its first chunk's frames (with right context)
    at one row, crosses to the detokenizer, decodes that window alone and crosses to the client."""
    calib, rates = scenario.calib, scenario.rates
    ready_frames, window_frames = scenario.chunk_rule().first_window(frames)
    tokens = ready_frames * rates.tokens_per_frame
    one_row_ms = float(calib.llm_step.step_ms(np.ones(1), np.asarray([prompt_tokens]))[0])
    llm_ms = tokens * one_row_ms * calib.pipeline_step_factor + prompt_tokens * calib.prefill_ms_per_token
    detok_ms = float(calib.detok.batch_ms(window_frames))
    compute_ms = llm_ms * options.step_scale + detok_ms * options.detok_scale
    return compute_ms / 1e3 + calib.llm_to_detok_s + calib.detok_to_client_s

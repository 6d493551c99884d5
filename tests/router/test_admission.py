"""Admission from both stages' measured pace (router.admission, router.detok_load), pure: no Ray."""

import pytest

from core.policy import MIN_STEP_SAMPLES, StepSamples, StepTimer
from router.admission import (
    STARTS_FRESH_S,
    STARTS_KEPT,
    STARTUP_CHUNKS,
    Admission,
    ReplicaLoad,
    StartTimes,
    admits_anywhere,
    decide,
    has_room,
    predict_ttfa_s,
    starting_allowed,
    stream_limit,
)
from router.detok_load import DetokLoad, DetokPace, step_s_at, summarize_detok


def load(num_active: int, real_time: float = 0.0, measured: int = 0, max_streams: int = 16) -> ReplicaLoad:
    return ReplicaLoad(num_active=num_active, max_streams=max_streams, max_queued=2, step_s=0.01,
                       first_chunk_tokens=49, avg_stream_s=4.0, real_time_streams=real_time,
                       measured_streams=measured)  # fmt: skip


def test_fixed_cap_policy_counts_streams_only():
    """admission.policy fixed_cap (the admission before prediction, for benchmarks): the measured
    pace and the TTFA deadline are not asked; the cap, then the queue."""
    from dataclasses import replace

    slow = dict(real_time=2.0, measured=8)  # predictive: limit 1, and any wait misses a 0.01 s deadline
    assert decide(load(3, **slow), 0.01) is Admission.REJECT
    fixed = replace(load(3, **slow, max_streams=4), predicts=False)
    assert decide(fixed, 0.01) is Admission.ADMIT
    assert decide(replace(fixed, num_active=5), 0.01) is Admission.QUEUE  # 4 running + 1 of 2 queued
    assert decide(replace(fixed, num_active=6), 0.01) is Admission.REJECT
    assert stream_limit(fixed) == 4  # the Router's own capacity check counts the same cap


def test_unmeasured_replica_admits_up_to_its_kv_cap():
    assert stream_limit(load(0)) == 16
    assert decide(load(15), 1.0) is Admission.ADMIT


def test_limit_follows_the_measured_pace_under_the_kv_cap():
    assert stream_limit(load(0, real_time=20.0, measured=8)) == 9  # probes one past the measured batch
    assert stream_limit(load(0, real_time=6.0, measured=8)) == 5  # 0.85 x 6 streams at real time
    assert stream_limit(load(0, real_time=100.0, measured=40)) == 16  # the KV cap still holds
    assert stream_limit(load(0, real_time=0.5, measured=1)) == 1  # never zero: one stream always runs


def test_a_batch_at_real_time_with_margin_to_spare_probes_one_stream_more():
    # one stream measured at 1.73x real time (a contended CPU): 0.85 x 1.73 >= 1, so a second one
    # is let in and its step measured; before, floor(0.85 x 1.73) = 1 held the replica at one stream
    assert stream_limit(load(0, real_time=1.73, measured=1)) == 2
    timer = StepTimer(steps_per_frame=7, frame_s=FRAME_S)
    budget_s = FRAME_S / 7  # a step this long keeps every stream exactly at real time
    streams = 1
    for step_s in (0.55 * budget_s, 0.6 * budget_s, 0.7 * budget_s, 0.8 * budget_s, 0.95 * budget_s):
        for _ in range(MIN_STEP_SAMPLES):
            timer.record_step(step_s, rows=streams)  # the batch the limit let in, measured
        paced = load(0, real_time=timer.measured_real_time_rows(), measured=streams)
        streams = stream_limit(paced)
    # grew one stream per measured batch while each kept real time with 15% to spare; 5 streams at
    # 0.95 of the budget leave none: back under the margin
    assert streams == 4


def test_past_the_limit_it_queues_only_what_starts_in_time_then_rejects():
    paced = dict(real_time=6.0, measured=8)  # limit 5
    assert decide(load(4, **paced), 1.0) is Admission.ADMIT
    assert decide(load(5, **paced), 60.0) is Admission.QUEUE
    assert decide(load(5, **paced), 0.6) is Admission.REJECT  # waiting for a stream to end takes longer
    assert decide(load(7, **paced), 60.0) is Admission.REJECT  # queue (2) full
    assert predict_ttfa_s(load(5, **paced)) > predict_ttfa_s(load(4, **paced))


def test_one_slow_step_at_a_new_batch_size_is_not_taken_as_its_speed():
    # on a shared CPU the first step at 2 rows took 3x the 1-row step (a burst beside it); taken as
    # the 2-row speed it held the replica at one stream and rejected a request at 0.5 req/s
    timer = StepTimer(steps_per_frame=7, frame_s=FRAME_S)
    for _ in range(MIN_STEP_SAMPLES):
        timer.record_step(0.0074, rows=1)
    timer.record_step(0.0237, rows=2)
    assert set(timer.step_s_by_rows) == {1}  # 2 rows: not measured yet, so the limit probes it
    assert stream_limit(load(1, real_time=timer.measured_real_time_rows(), measured=1)) == 2
    timer.record_step(0.0075, rows=2)
    timer.record_step(0.0076, rows=2)
    assert timer.step_s_by_rows[2] == 0.0076  # the median of its steps, not the outlier's pull


def test_a_batch_measured_slow_in_a_passing_burst_is_probed_again():
    # 4 streams stepped at 14.7 ms in a burst on the box: the limit fell under 4, so 4 never ran
    # again and its figure held the replica at 3 streams for the rest of the run
    clock = [0.0]
    timer = StepTimer(steps_per_frame=7, frame_s=FRAME_S, steps_by_rows=StepSamples(clock=lambda: clock[0]))
    for _ in range(MIN_STEP_SAMPLES):
        timer.record_step(0.0147, rows=4)
    assert stream_limit(load(3, real_time=timer.measured_real_time_rows(), measured=4)) == 2  # 0.85 x 3.3
    for _ in range(40):  # 3 streams step fast for a while
        timer.record_step(0.004, rows=3)
        clock[0] += 0.5
    assert set(timer.step_s_by_rows) == {3}  # 4 rows: stale while 3 rows are measured now
    assert stream_limit(load(3, real_time=timer.measured_real_time_rows(), measured=3)) == 4  # probed again
    clock[0] += 60.0  # idle: nothing fresh, so all it knows counts
    assert set(timer.step_s_by_rows) == {3, 4}


def test_step_timer_reports_the_largest_measured_batch_at_its_own_speed():
    timer = StepTimer(steps_per_frame=7, frame_s=2048 / 24000)
    assert StepTimer(steps_per_frame=7).measured_real_time_rows() is None
    for _ in range(MIN_STEP_SAMPLES):
        timer.record_step(0.004, rows=2)
        timer.record_step(0.006, rows=4)
    rows_at_real_time = 4 * (2048 / 24000) / (7 * 0.006)
    assert abs(timer.measured_real_time_rows() - rows_at_real_time) < 1e-9
    assert timer.sustainable_streams(16) > timer.measured_real_time_rows()  # that one extrapolates to 16 rows


def test_a_starving_stream_holds_new_admissions():
    paced = dict(real_time=20.0, measured=8)  # limit 9
    assert decide(load(4, **paced), 60.0) is Admission.ADMIT
    behind = ReplicaLoad(**{**load(4, **paced).to_stats(), "num_starving": 1})
    assert stream_limit(behind) == 4 and decide(behind, 60.0) is Admission.QUEUE


# ---- both stages: the detok replicas' measured pace (router.detok_load) ----------------------

FRAME_S = 2048 / 24000


def measured_detok(step_s: float, chunks: int, chunk_frames: int = 8, queued: int = 0) -> DetokLoad:
    """A detok replica's report after decoding batches of `chunks` chunks of `chunk_frames` frames."""
    clock = [0.0]
    pace = DetokPace(clock=lambda: clock[0])
    pace.record_step(9.0, [chunk_frames * FRAME_S] * chunks, ["warm-up"], finished_ids=["warm-up"])  # not counted
    for _ in range(3):
        pace.record_step(step_s, [chunk_frames * FRAME_S] * chunks, [f"s{i}" for i in range(chunks)])
        clock[0] += 0.1
    return pace.load(num_queued_chunks=queued)


def with_detok(base: ReplicaLoad, detok: list[DetokLoad], own_streams: int | None = None) -> ReplicaLoad:
    """`base` as the LLM replica reports it next to the detok stage `detok`."""
    summary = summarize_detok(detok)
    own = base.num_active if own_streams is None else own_streams
    return ReplicaLoad(**{**base.to_stats(), "detok_real_time_streams": summary.real_time_streams,
                          "detok_other_streams": max(0, summary.num_streams - own),
                          "detok_first_chunk_s": summary.first_chunk_s})  # fmt: skip


def test_detok_pace_reports_streams_it_keeps_at_real_time_from_its_measured_steps():
    detok = measured_detok(step_s=0.2, chunks=4)  # 4 chunks of 0.68 s audio decoded in 0.2 s
    assert abs(detok.real_time_streams() - 4 * 8 * FRAME_S / 0.2) < 1e-9
    assert detok.num_streams == 4
    assert detok.first_chunk_s() == 0.2  # nothing queued: one step
    assert measured_detok(step_s=0.2, chunks=4, queued=9).first_chunk_s() == 3 * 0.2  # 10 chunks: 3 steps of 4
    assert DetokLoad.from_stats(detok.to_stats()) == detok
    assert summarize_detok([]).real_time_streams == 0  # unknown until a replica measured a step


def test_a_slow_detok_stage_limits_admission_below_the_llm_pace():
    llm_paced = load(4, real_time=40.0, measured=16)  # the LLM alone: 16 (its KV cap)
    assert stream_limit(llm_paced) == 16
    slow = measured_detok(step_s=0.6, chunks=4)  # its 4 streams: 4 x 0.68 s / 0.6 s = 4.55 at real time
    assert stream_limit(with_detok(llm_paced, [slow])) == 3  # floor(0.85 x 4.55) - 0 others
    assert decide(with_detok(llm_paced, [slow]), 60.0) is Admission.QUEUE  # full: a fourth waits
    assert stream_limit(with_detok(llm_paced, [slow, slow])) == 7  # a second detok replica: floor(0.85 x 9.1)
    busy_elsewhere = with_detok(llm_paced, [slow], own_streams=1)
    assert stream_limit(busy_elsewhere) == 1  # 3 of the 4 streams there come from another LLM replica
    spare = measured_detok(step_s=0.5, chunks=4)  # 5.46 at real time: the margin under it, no probe
    assert stream_limit(with_detok(llm_paced, [spare])) == 4


def test_detok_capacity_follows_its_cost_per_audio_second_not_its_largest_batch():
    # 5 streams whose chunks never met in one decode step: the stage kept them all at real time with
    # room to spare, yet a probe by chunks per step held admission at 2 (batch 1 + 1)
    clock = [0.0]
    pace = DetokPace(clock=lambda: clock[0])
    pace.record_step(3.0, [0.17], ["cold"], finished_ids=["cold"])  # warm-up, not measured
    for step in range(40):
        pace.record_step(0.02, [0.17], [f"s{step % 5}"])  # one 0.17 s chunk per 20 ms step
        clock[0] += 0.034
    detok = pace.load(0)
    assert abs(detok.real_time_streams() - 0.17 / 0.02) < 1e-9 and detok.num_streams == 5
    llm_paced = load(5, real_time=40.0, measured=16)
    assert stream_limit(with_detok(llm_paced, [detok], own_streams=5)) == 7  # floor(0.85 x 8.5)
    clock[0] += 60.0  # idle: the last figure stands until new steps measure it again
    assert pace.load(0).real_time_streams() == detok.real_time_streams()


def test_predicted_ttfa_counts_the_first_chunks_decode_and_the_step_at_the_would_be_batch():
    idle = load(0)
    generate_s = (idle.first_chunk_tokens + 1) * idle.step_s
    assert predict_ttfa_s(idle) == generate_s
    queued_detok = with_detok(idle, [measured_detok(step_s=0.1, chunks=2, queued=5)])  # 6 chunks: 3 steps
    assert abs(predict_ttfa_s(queued_detok) - (generate_s + 3 * 0.1)) < 1e-9
    timer = StepTimer(steps_per_frame=7, frame_s=FRAME_S)
    for rows, step_s in ((1, 0.01), (4, 0.02), (8, 0.05)) * MIN_STEP_SAMPLES:
        timer.record_step(step_s, rows=rows)
    assert step_s_at(timer.step_s_by_rows, 3) == 0.02  # 3 rows run at the 4-row batch's measured step
    assert step_s_at(timer.step_s_by_rows, 16) == 0.1  # past the largest measured: scaled, not assumed equal
    slower = ReplicaLoad(**{**idle.to_stats(), "next_step_s": step_s_at(timer.step_s_by_rows, 16)})
    assert predict_ttfa_s(slower) == (idle.first_chunk_tokens + 1) * 0.1


def test_a_stream_whose_first_audio_misses_its_deadline_is_rejected_even_with_room():
    busy = with_detok(load(1, real_time=20.0, measured=8), [measured_detok(step_s=0.25, chunks=1)], own_streams=1)
    assert stream_limit(busy) > 1 and predict_ttfa_s(busy) > 0.5
    assert decide(busy, 0.5) is Admission.REJECT
    assert decide(busy, 2.0) is Admission.ADMIT
    assert not admits_anywhere([busy], 0.5) and admits_anywhere([busy, load(1)], 0.6)
    assert admits_anywhere([], 0.01)  # nothing known yet: the LLM replica decides


def test_an_idle_replica_admits_whatever_its_last_figures_predict():
    # a cold first decode measured seconds; with nothing running nothing measures it again, so
    # rejecting on it locked the app out for good (the overload benchmark on a busy box)
    stale = with_detok(load(0), [measured_detok(step_s=3.5, chunks=1)])
    assert predict_ttfa_s(stale) > 1.0
    assert decide(stale, 1.0) is Admission.ADMIT and admits_anywhere([stale], 1.0)


def test_detok_counts_running_streams_not_cfg_rows_nor_ended_ones():
    # a guided stream and its twin decode as one stream: the twin's rows send no chunks
    clock = [0.0]
    pace = DetokPace(clock=lambda: clock[0])
    pace.record_step(3.0, [0.5], ["cold"], finished_ids=["cold"])  # the first decode: a warm-up, not measured
    assert pace.load(0).step_s_by_chunks == {} and pace.load(0).num_streams == 0
    pace.record_step(0.1, [0.5, 0.5, 0.5], ["guided-a", "guided-b", "short"], finished_ids=["short"])
    assert pace.load(0).num_streams == 2  # "short" got its final chunk
    pace.forget(["guided-b"])  # cancelled
    assert pace.load(0).num_streams == 1
    clock[0] += 2.5  # no chunk for longer than the window: gone (a stream lost upstream)
    assert pace.load(0).num_streams == 0


def test_streams_past_the_startup_limit_wait_for_the_starts_ahead_of_them():
    """A burst: streams started together underran, so past `startup_limit` streams starting at
    once one more waits a wave of starts per limit ahead of it, queued when that still makes its
    deadline, refused at once when not; room is back as soon as a start ends."""
    from dataclasses import replace

    starting = replace(load(3, real_time=20.0, measured=8), num_starting=2, startup_limit=2, startup_s=1.5)
    generate_s = predict_ttfa_s(replace(starting, num_starting=0))  # 0.5 s: 50 steps of 10 ms
    assert not has_room(starting)  # 3 running of a limit of 9, but 2 of them starting
    assert predict_ttfa_s(starting) == pytest.approx(generate_s + 1.5)
    assert predict_ttfa_s(starting, extra_requests=2) == pytest.approx(generate_s + 3.0)  # the next wave
    # recent starts faster than a start's own cost (2 chunks' worth of first chunks) are not promised
    assert predict_ttfa_s(replace(starting, startup_s=0.1)) == pytest.approx(generate_s + 2 * generate_s)
    assert decide(starting, 5.0) is Admission.QUEUE
    assert decide(starting, generate_s + 1.4) is Admission.REJECT  # one wave is longer than it can wait
    assert decide(replace(starting, num_starting=1), generate_s + 0.1) is Admission.ADMIT
    assert has_room(replace(starting, predicts=False))  # fixed_cap: the cap only
    # the starts running now have run a while: the first wave is what the oldest has left
    partway = replace(starting, starting_for_s=(1.0, 0.4))
    assert predict_ttfa_s(partway) == pytest.approx(generate_s + 0.5)
    assert predict_ttfa_s(partway, extra_requests=1) == pytest.approx(generate_s + 1.1)  # waits for the second
    assert predict_ttfa_s(partway, extra_requests=2) == pytest.approx(generate_s + 3.0)  # the next wave: whole
    assert predict_ttfa_s(replace(starting, starting_for_s=(2.0, 1.8))) == pytest.approx(generate_s)  # overdue


def test_a_busy_replica_lets_fewer_streams_start_at_once():
    """A starting stream weighs two playing ones: with a limit of 9, a replica with none playing lets
    4 start together (its startup limit), one with 6 playing steadily one at a time."""
    from dataclasses import replace

    idle = replace(load(0, real_time=11.0, measured=10), startup_limit=4, startup_s=1.5)  # limit 9 (0.85 x 11)
    assert stream_limit(idle) == 9 and starting_allowed(idle) == 4
    assert has_room(replace(idle, num_active=3, num_starting=3))
    assert starting_allowed(replace(idle, num_active=3, num_starting=1)) == 3  # 2 playing: (9 - 2) // 2
    busy = replace(idle, num_active=6)  # 6 playing
    assert starting_allowed(busy) == 1 and has_room(busy)
    one_starting = replace(busy, num_active=7, num_starting=1)
    assert not has_room(one_starting)  # 7 running of 9, but one is starting
    generate_s = predict_ttfa_s(busy)
    assert predict_ttfa_s(one_starting) == pytest.approx(generate_s + 1.5)  # waits for that start
    assert decide(one_starting, generate_s + 1.0) is Admission.REJECT  # refused at once, not queued
    assert starting_allowed(replace(idle, num_active=8)) == 1  # the last slot still fills
    assert has_room(replace(one_starting, predicts=False))  # fixed_cap: the cap only
    probing = replace(idle, real_time_streams=20.0, measured_streams=1, num_active=1, num_starting=1)  # probing: 2
    assert stream_limit(probing) == 2 and starting_allowed(probing) == 4 and has_room(probing)  # none playing
    # the room is counted under the pace (0.85 x 10.6 = 9 streams), not the probe (one past 5 measured)
    probing = replace(idle, real_time_streams=10.6, measured_streams=5, num_active=4, num_starting=2)
    assert stream_limit(probing) == 6 and starting_allowed(probing) == 3 and has_room(probing)


def test_a_queued_stream_waits_for_the_running_streams_to_end_not_a_mean_share():
    """Past the stream limit one more waits until as many running streams have ended as it has
    places ahead (their most left, `ends_in_s`), not a share of the mean lifetime per place: streams
    a burst started together end together (a stream queued on the mean was refused after waiting)."""
    from dataclasses import replace

    full = replace(load(5, real_time=6.0, measured=6), avg_stream_s=2.5)  # limit 5 (0.85 x 6)
    generate_s = predict_ttfa_s(load(0, real_time=6.0, measured=6))
    assert predict_ttfa_s(full) == pytest.approx(generate_s + 2.5 / 5)  # unknown ends: the mean's share
    burst = replace(full, ends_in_s=(2.4, 2.4, 2.5, 2.5, 2.6))
    assert predict_ttfa_s(burst) == pytest.approx(generate_s + 2.4)
    assert decide(burst, 1.0) is Admission.REJECT  # before: queued for 0.5 s, then refused
    ending = replace(full, ends_in_s=(0.1, 0.2, 2.5, 2.5, 2.6))
    assert predict_ttfa_s(ending) == pytest.approx(generate_s + 0.1)
    assert predict_ttfa_s(ending, extra_requests=1) == pytest.approx(generate_s + 0.2)
    assert decide(ending, 1.0) is Admission.QUEUE
    assert predict_ttfa_s(ending, extra_requests=5) >= 2.6  # past the known ends: never sooner than the last
    # one that waits starts as recent streams did (the replica refuses it by that), not as predicted
    slow_starts = replace(ending, measured_first_chunk_s=0.95)
    assert predict_ttfa_s(slow_starts) == pytest.approx(0.95 + 0.1)
    assert decide(slow_starts, 1.0) is Admission.REJECT  # at once, not after waiting
    assert predict_ttfa_s(replace(slow_starts, num_active=1)) == pytest.approx(generate_s)  # no wait: as predicted


def test_start_times_report_a_recent_high_percentile_and_forget_old_starts():
    now = [0.0]
    times = StartTimes(clock=lambda: now[0])
    assert times.startup_s() == times.first_chunk_s() == 0.0  # none measured: the prediction stands
    for seconds in (0.5, 0.6, 0.55, 0.58, 1.3, 0.57, 0.6, 0.59, 0.61, 1.4):
        times.record(1, seconds / 2)
        times.record(STARTUP_CHUNKS, seconds)
    assert times.startup_s() == 1.3  # two in ten took that long: a promise from it holds nine times in ten
    assert times.first_chunk_s() == 0.65
    for _ in range(STARTS_KEPT):
        times.record(STARTUP_CHUNKS, 0.6)
    assert times.startup_s() == 0.6  # the last STARTS_KEPT count
    now[0] = STARTS_FRESH_S + 1.0
    assert times.startup_s() == 0.0  # a burst's slow starts do not hold admission down for good


def test_a_prediction_far_past_what_new_streams_measured_refuses_nothing():
    """During a failover the survivor's prediction ran on a transient (39.5 s predicted, 2.2 s met):
    a request is refused for its deadline only on a prediction within `credible_ttfa_factor` x the
    measured p90 TTFA; past it, it is admitted under the limits, or queued, as if it met it."""
    from dataclasses import replace

    full = replace(load(5, real_time=6.0, measured=6), ends_in_s=(39.0, 39.0, 39.0, 39.0, 39.0))  # limit 5
    assert predict_ttfa_s(full) > 39.0
    assert decide(full, 15.0) is Admission.REJECT  # nothing measured to hold it to: it stands
    measured = replace(full, measured_ttfa_s=2.0)  # 3 x 2 s = 6 s < 39 s: a transient
    assert decide(measured, 15.0) is Admission.QUEUE and admits_anywhere([measured], 15.0)
    assert decide(replace(measured, num_active=1, ends_in_s=(39.0,), num_starting=4, startup_limit=4,
                          starting_for_s=(0.0,) * 4, startup_s=40.0), 15.0) is Admission.QUEUE  # fmt: skip
    assert decide(replace(measured, num_active=7), 15.0) is Admission.REJECT  # its queue is full: refused still
    credible = replace(full, measured_ttfa_s=14.0)  # 39 s is under 3 x 14 s
    assert decide(credible, 15.0) is Admission.REJECT and not admits_anywhere([credible], 15.0)
    assert decide(replace(measured, credible_ttfa_factor=0.0), 15.0) is Admission.REJECT  # the bound off


def test_a_prediction_on_the_step_prior_alone_refuses_nothing():
    """A fresh replica's report taken before its first step predicts from DEFAULT_STEP_S: a lone
    client's second request (its first just cancelled, still counted) was refused on the prior's
    0.72 s against a 0.5 s deadline, though its first had met its first audio in 0.09 s."""
    from dataclasses import replace

    fresh = replace(load(1), step_s=0.0, first_chunk_tokens=35)
    assert predict_ttfa_s(fresh) == pytest.approx(0.72)
    assert decide(fresh, 0.5) is Admission.ADMIT and admits_anywhere([fresh], 0.5)
    measured = replace(fresh, step_s=0.02)  # the same figure, measured: it refuses
    assert decide(measured, 0.5) is Admission.REJECT and not admits_anywhere([measured], 0.5)
    assert decide(replace(fresh, next_step_s=0.02), 0.5) is Admission.REJECT


def test_start_times_measure_the_ttfa_from_arrival_queue_included():
    times = StartTimes()
    assert times.ttfa_s() == 0.0
    times.record(1, 0.3, since_arrival_s=1.2)  # held 0.9 s in the queue first
    times.record(1, 0.4)  # not held: as it started
    assert times.first_chunk_s() == 0.4 and times.ttfa_s() == 1.2
    times.record(STARTUP_CHUNKS, 0.9, since_arrival_s=5.0)  # only first chunks count
    assert times.ttfa_s() == 1.2


def test_the_steady_step_leaves_out_steps_that_prefilled():
    """A resumed stream's prefill (its prompt and every token it had sent) took seconds on a
    survivor: admission's step is the decode-only steps' EMA, the policy's keeps every step."""
    timer = StepTimer(step_s=0.01)
    assert timer.steady_step_s == 0.01  # nothing measured: the prior
    assert timer.measured_step_s == 0.0  # what a load report carries then (admission: not credible)
    for _ in range(5):
        timer.record_step(0.02, rows=4)
    timer.record_step(3.0, rows=0)  # a step that prefilled
    assert timer.steady_step_s == pytest.approx(0.02) and timer.step_s > 0.3
    assert timer.measured_step_s == timer.steady_step_s

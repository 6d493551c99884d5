"""Admission from measured pace (router.admission), pure: no Ray."""

from core.policy import StepTimer
from router.admission import Admission, ReplicaLoad, decide, predict_ttfa_s, stream_limit


def load(num_active: int, real_time: float = 0.0, measured: int = 0, max_streams: int = 16) -> ReplicaLoad:
    return ReplicaLoad(num_active=num_active, max_streams=max_streams, max_queued=2, step_s=0.01,
                       first_chunk_tokens=49, avg_stream_s=4.0, real_time_streams=real_time,
                       measured_streams=measured)  # fmt: skip


def test_unmeasured_replica_admits_up_to_its_kv_cap():
    assert stream_limit(load(0)) == 16
    assert decide(load(15), 1.0) is Admission.ADMIT


def test_limit_follows_the_measured_pace_under_the_kv_cap():
    assert stream_limit(load(0, real_time=20.0, measured=8)) == 9  # probes one past the measured batch
    assert stream_limit(load(0, real_time=6.0, measured=8)) == 5  # 0.85 x 6 streams at real time
    assert stream_limit(load(0, real_time=100.0, measured=40)) == 16  # the KV cap still holds
    assert stream_limit(load(0, real_time=0.5, measured=1)) == 1  # never zero: one stream always runs


def test_past_the_limit_it_queues_only_what_starts_in_time_then_rejects():
    paced = dict(real_time=6.0, measured=8)  # limit 5
    assert decide(load(4, **paced), 1.0) is Admission.ADMIT
    assert decide(load(5, **paced), 60.0) is Admission.QUEUE
    assert decide(load(5, **paced), 0.6) is Admission.REJECT  # waiting for a stream to end takes longer
    assert decide(load(7, **paced), 60.0) is Admission.REJECT  # queue (2) full
    assert predict_ttfa_s(load(5, **paced)) > predict_ttfa_s(load(4, **paced))


def test_step_timer_reports_the_largest_measured_batch_at_its_own_speed():
    timer = StepTimer(tokens_per_frame=7, frame_s=2048 / 24000)
    assert StepTimer(tokens_per_frame=7).measured_real_time_rows() is None
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

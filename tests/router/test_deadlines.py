"""The gRPC client's deadline applied to a job (`router.deadlines`)."""

from __future__ import annotations

import pytest

from core.messages import Job, SamplingParams
from router.admission import ReplicaLoad
from router.deadlines import DeadlineUnmeetable, best_predicted_ttfa_s, fit_to_client_deadline


def _job(ttfa_deadline_s: float = 5.0) -> Job:
    return Job(req_id="r", text="hi", voice=None, sampling=SamplingParams(), ttfa_deadline_s=ttfa_deadline_s)


def test_no_client_deadline_leaves_the_job_alone():
    job = _job()
    assert fit_to_client_deadline(job, None, 0.3) is job


def test_the_ttfa_deadline_is_cut_to_the_clients():
    assert fit_to_client_deadline(_job(5.0), 2.0, 0.3).ttfa_deadline_s == 2.0
    assert fit_to_client_deadline(_job(1.0), 2.0, 0.3).ttfa_deadline_s == 1.0
    assert fit_to_client_deadline(_job(5.0), 2.0, None).ttfa_deadline_s == 2.0  # no replica known yet


@pytest.mark.parametrize("remaining_s, predicted_s", [(0.1, 0.3), (0.0, None), (-1.0, 0.1)])
def test_a_deadline_before_the_predicted_first_audio_is_rejected_at_once(remaining_s, predicted_s):
    with pytest.raises(DeadlineUnmeetable, match="cannot start in time"):
        fit_to_client_deadline(_job(), remaining_s, predicted_s)


def test_the_best_replica_predicts():
    idle = ReplicaLoad(num_active=0, max_streams=4, max_queued=2, step_s=0.02, first_chunk_tokens=14, avg_stream_s=0)
    busy = ReplicaLoad(num_active=4, max_streams=4, max_queued=2, step_s=0.02, first_chunk_tokens=14, avg_stream_s=8)
    assert best_predicted_ttfa_s([busy, idle]) == pytest.approx(15 * 0.02)
    assert best_predicted_ttfa_s([]) is None


def test_a_prediction_on_a_transient_refuses_no_client_deadline():
    """A replica predicting far past what its new streams measured (`router.admission.is_credible`):
    the best prediction is not known, so the client's deadline cuts the job and nothing is refused."""
    from dataclasses import replace

    idle = ReplicaLoad(num_active=0, max_streams=4, max_queued=2, step_s=0.02, first_chunk_tokens=14, avg_stream_s=0)
    transient = replace(idle, step_s=2.0, measured_ttfa_s=0.5)  # predicts 30 s, its streams met 0.5 s
    assert best_predicted_ttfa_s([transient]) is None and best_predicted_ttfa_s([transient, idle]) is None
    assert best_predicted_ttfa_s([replace(transient, measured_ttfa_s=12.0)]) == pytest.approx(30.0)
    assert fit_to_client_deadline(_job(), 15.0, best_predicted_ttfa_s([transient])).ttfa_deadline_s == 5.0

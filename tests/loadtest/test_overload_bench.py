"""loadtest/overload_bench.py's per-phase figures from client records (no server needed)."""

from __future__ import annotations

from loadtest.metrics import RequestRecord
from loadtest.overload_bench import REJECTED, Sent, max_at_once, summarize_phase


def played(ttfa_s: float, num_chunks: int = 3, chunk_s: float = 0.5) -> RequestRecord:
    """A stream whose chunks arrive on time: the first after `ttfa_s`, then one per chunk played."""
    return RequestRecord(arrivals_s=[ttfa_s + i * chunk_s * 0.5 for i in range(num_chunks)],
                         durations_s=[chunk_s] * num_chunks)  # fmt: skip


def test_admitted_share_viability_ttfa_and_reject_latency():
    late = RequestRecord(arrivals_s=[0.3, 2.0], durations_s=[0.5, 0.5])  # its second chunk came after an underrun
    sent = [
        Sent(played(0.4), sent_s=0.0, ended_s=2.0),
        Sent(played(0.6), sent_s=0.5, ended_s=2.5),
        Sent(late, sent_s=1.0, ended_s=3.0),
        Sent(RequestRecord(is_ok=False, error=REJECTED), sent_s=1.2, ended_s=1.25),
        Sent(RequestRecord(is_ok=False, error=REJECTED), sent_s=1.3, ended_s=1.32),
    ]
    phase = summarize_phase("test", 2.0, sent)
    assert (phase.num_sent, phase.num_admitted, phase.pct_admitted) == (5, 3, 60.0)
    assert abs(phase.pct_admitted_viable - 200 / 3) < 1e-9  # the late one is admitted but not viable
    assert 0.4 <= phase.admitted_ttfa_p90_s <= 0.6
    assert 45 <= phase.reject_latency_p99_ms <= 50
    assert phase.max_admitted_at_once == 3 and phase.errors == {REJECTED: 2}


def test_most_spans_open_at_once():
    assert max_at_once([]) == 0
    assert max_at_once([(0, 2), (1, 3), (2.5, 4)]) == 2
    assert max_at_once([(0, 1), (0, 1), (0, 1)]) == 3

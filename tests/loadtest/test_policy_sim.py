"""The scheduling simulator: real scheduler, policy and chunker on a fake clock."""

from __future__ import annotations

from loadtest.policy_sim import SimSetup, report, simulate

QUIET = SimSetup(drift=0.0, noise=0.0)


def test_a_lone_request_gets_first_audio_after_its_first_chunk_and_plays_without_a_gap():
    result = simulate("streaming", rate=0.05, count=3, seed=7, setup=QUIET)
    # first chunk = 4 frames + 3 of right context = 49 tokens at 5.3 ms, one 20-token prefill step,
    # up to 6 steps held for the head phase, and one 7-frame detokenizer window (3 + 7 x 1.6 ms)
    assert 0.27 < result.p50_ttfa_s < 0.32
    assert result.viable_pct == 100.0 and result.worst_underrun_s == 0.0


def test_same_seed_same_run():
    setup = SimSetup()  # with step-time drift and noise: both come from the seed
    assert simulate("streaming", 1.5, 24, 9, setup) == simulate("streaming", 1.5, 24, 9, setup)


def test_with_headroom_startups_go_ahead_and_cut_the_ttfa_tail_without_underruns():
    fast = SimSetup(step_scale=0.4, drift=0.0, noise=0.0)  # streams at ~3.5x real time on 4 rows
    for seed in (7, 8):
        fcfs = simulate("fcfs", 5.0, 48, seed, fast)
        streaming = simulate("streaming", 5.0, 48, seed, fast)
        assert streaming.p90_ttfa_s < 0.8 * fcfs.p90_ttfa_s
        assert streaming.viable_pct == 100.0


def test_report_finds_the_rate_where_fcfs_doubles():
    results = [
        simulate(policy, rate, 48, 7, SimSetup(step_scale=0.4))
        for rate in (0.5, 5.0)
        for policy in ("fcfs", "streaming")
    ]
    text = report(results)
    assert "| 5.0 | streaming |" in text and "FCFS p90 doubles by rate 5.0; streaming there: " in text

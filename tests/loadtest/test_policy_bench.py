"""policy_bench: rates set as shares of the measured capacity, and the report's doubling line."""

from __future__ import annotations

import torch

from cluster.pipeline import InProcessPipeline
from loadtest.policy_bench import RunResult, bench_config, capacity_req_s, report


def run(policy: str, load: float, p90_s: float, viable: float = 100.0, repeat: int = 0) -> RunResult:
    return RunResult(policy, 10.0 * load, repeat, p90_s / 2, p90_s, viable, 0.0, load=load)


def test_report_groups_by_load_and_finds_where_fcfs_doubles():
    results = [
        run("fcfs", 0.1, 0.10), run("streaming", 0.1, 0.08),
        run("fcfs", 0.6, 0.15), run("streaming", 0.6, 0.10),
        run("fcfs", 0.8, 0.21), run("streaming", 0.8, 0.12, viable=97.0),
        run("fcfs", 0.8, 0.25, repeat=1), run("streaming", 0.8, 0.14, repeat=1),
    ]  # fmt: skip
    text = report(results)
    assert "| 0.8 | fcfs | 0.230 s | 0.230 s | 100.0% (100) |" in text  # median of the two repeats
    assert "FCFS p90 doubles by load 0.8; streaming there: 1.62x its low-load p90, 98.5% viable (min 97%)" in text


def test_report_says_nothing_of_doubling_when_fcfs_never_doubles():
    text = report([run("fcfs", 0.1, 0.10), run("streaming", 0.1, 0.08), run("fcfs", 0.6, 0.19)])
    assert "doubles" not in text


def test_capacity_is_measured_on_the_pipeline_and_leaves_it_idle():
    torch.manual_seed(0)
    pipeline = InProcessPipeline(bench_config("fcfs", batch=2, slots=4))
    try:
        capacity = capacity_req_s(pipeline, count=4, max_tokens=28)
        assert capacity > 0 and not pipeline.has_work
        assert capacity_req_s(pipeline, count=4, max_tokens=28, tag="-again") > 0  # fresh request ids each time
    finally:
        pipeline.close()

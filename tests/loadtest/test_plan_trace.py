"""The planner's simulation traced in the figures loop_stalls prints for the real cluster."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.planner.calibration import CALIBRATION_DIR, parse_calibration
from cluster.planner.predict import Scenario
from cluster.planner.simulate import AdmissionTrace
from loadtest.plan_check import CONFIGS, ORPHEUS_TINY, sweep_workload
from loadtest.plan_trace import core_share_summary, format_row, main, trace_rate


def test_admission_is_summarised_over_time_not_steps():
    trace = AdmissionTrace(
        clock_s=np.asarray([[0.0], [1.0], [1.1], [9.0]]), step_s=np.asarray([[1.0], [0.1], [0.9], [1.0]]),
        limit=np.asarray([[2], [4], [6], [12]]), num_open=np.asarray([[1], [4], [6], [12]]),
        held=np.asarray([[False], [True], [False], [True]]), measured_rows=np.asarray([[0], [3], [5], [11]]),
        real_time=np.asarray([[0.0], [5.0], [7.0], [13.0]]), starts_full=np.asarray([[True], [False], [True], [True]]),
    )  # fmt: skip
    summary = trace.summary((0.0, 5.0))  # the last step began outside the window
    assert summary["mean_measured_rows"] == pytest.approx((3 * 0.1 + 5 * 0.9) / 2.0)
    assert summary["mean_real_time_streams"] == pytest.approx((5 * 0.1 + 7 * 0.9) / 2.0)
    assert summary["mean_limit"] == pytest.approx((2 * 1.0 + 4 * 0.1 + 6 * 0.9) / 2.0)
    assert summary["held_share"] == pytest.approx(0.1 / 2.0)
    assert summary["mean_open"] == pytest.approx((1 + 0.4 + 5.4) / 2.0)
    assert summary["full_share"] == pytest.approx((0.1 + 0.9) / 2.0)  # open at the limit, waiting or not
    assert summary["starts_full_share"] == pytest.approx((1.0 + 0.9) / 2.0)


def test_a_busy_loop_sees_the_loops_busy_beside_it():
    llm, detok, host = np.asarray([2.0, 0.0, 2.0, 0.0]), np.asarray([1.0, 0.0, 1.0, 0.0]), np.full(4, 0.1)
    out = core_share_summary(llm, detok, host, (0.0, 0.04))
    assert (out["llm_busy"], out["detok_busy"], out["host_cores"]) == (1.0, 0.5, pytest.approx(0.1))
    assert out["busy_weighted_loops"] == 3.0  # busy half the time, three at once: a busy loop sees 3, not 1.5


def _shared_scenario() -> Scenario:
    data = json.loads((CALIBRATION_DIR / "cpu-orpheus-tiny.json").read_text())
    data["host"] = {"cores": 2, "background_cores": 0.07, "background_cores_per_replica": 0.035,
                    "cpu_ms_per_stream": 15.0, "cpu_ms_per_chunk": 2.0}  # fmt: skip
    return Scenario(parse_calibration(data), ORPHEUS_TINY, sweep_workload())


def test_a_traced_draw_reports_outcome_admission_and_the_shared_cores():
    scenario, config = _shared_scenario(), next(c for c in CONFIGS if c.name == "cpu-2x2")
    light, heavy = (trace_rate(scenario, config, rps, seed=0, min_measured=30) for rps in (0.3, 6.0))
    for row in (light, heavy):
        assert 1.0 <= row["mean_limit"] <= config.max_streams_per_replica
        assert 0.0 <= row["held_share"] <= 1.0 and row["llm_busy"] > 0 and row["host_cores"] > 0
    assert heavy["held_share"] > light["held_share"]
    assert heavy["llm_busy"] > light["llm_busy"] and heavy["busy_weighted_loops"] > light["busy_weighted_loops"]
    assert "held a waiting stream" in format_row(heavy) and "busy-weighted" in format_row(heavy)


def test_the_command_writes_its_rows(tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text((CALIBRATION_DIR / "cpu-orpheus-tiny.json").read_text())  # no host: cores not shared
    rows = main(["--calibration", str(calibration), "--config", "cpu-1x1", "--rps", "0.5", "--seeds", "3",
                 "--min-measured", "30", "--json", str(tmp_path / "rows.json")])  # fmt: skip
    assert rows[0]["seed"] == 3 and "llm_busy" not in rows[0] and "mean_limit" in rows[0]
    assert json.loads((tmp_path / "rows.json").read_text()) == rows

"""The planner-vs-cluster check's pure parts (calibration rewrite, workload, rates, verdict); no Ray started."""

from __future__ import annotations

import json

import numpy as np

from cluster.planner.calibration import parse_calibration
from cluster.planner.predict import Scenario
from cluster.planner.search import Slo
from loadtest.plan_check import (
    CONFIGS,
    CPU_CALIBRATION,
    ORPHEUS_TINY,
    CheckResult,
    calibration_with_steps,
    predicted_rps,
    sweep_workload,
    swept_rates,
)
from loadtest.workload import MAX_FRAMES, MIN_FRAMES, load_prompts, max_tokens_for


def test_the_measured_steps_replace_the_table_and_say_so():
    base = json.loads(CPU_CALIBRATION.read_text())
    data = calibration_with_steps(base, {4: 7.0, 1: 5.0}, "step_bench here")
    calib = parse_calibration(data)
    assert calib.llm_step.rows == (1, 4) and calib.llm_step.step_ms(np.asarray([4]), np.asarray([50.0]))[0] == 7.0
    assert data["sources"]["llm.step_ms"] == "step_bench here"
    assert base["llm"]["step_ms"]["rows"] != [1, 4]  # the bundled file is left as it was


def test_the_workload_cuts_the_sweeps_prompts_into_the_sweeps_frames():
    workload = sweep_workload()
    chars = np.asarray(workload.text_chars, np.float64)
    frames = workload.frames_for(chars, ORPHEUS_TINY)
    expected = [max_tokens_for(text) // 7 for text in load_prompts()]
    assert frames.min() >= MIN_FRAMES and frames.max() <= MAX_FRAMES
    assert np.abs(frames - np.asarray(expected)).max() <= 1  # the same ~0.78 frames per character


def test_rates_bracket_the_prediction_and_the_verdict_is_25_pct():
    rates = swept_rates(1.0)
    assert min(rates) < 1.0 < max(rates) and 1.0 in rates
    assert CheckResult("x", 1.2, 1.0, rates).within_25_pct
    assert not CheckResult("x", 1.3, 1.0, rates).within_25_pct
    assert not CheckResult("x", 1.0, 0.0, rates).within_25_pct


def test_the_prediction_for_the_default_cpu_config_is_a_positive_rate():
    calib = parse_calibration(json.loads(CPU_CALIBRATION.read_text()))
    scenario = Scenario(calib, ORPHEUS_TINY, sweep_workload())
    one = next(c for c in CONFIGS if c.name == "cpu-1x1")
    assert 0 < predicted_rps(scenario, one, Slo(1.0)) < 100

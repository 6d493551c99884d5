"""The prepared GPU check runs end to end on CPU (graphs fall back to eager), so it is ready when
a session is lent a device."""

from __future__ import annotations

import json
import sys

from loadtest import gpu_check


def test_gpu_check_runs_on_cpu_and_reports_every_mode(tmp_path, monkeypatch):
    out = tmp_path / "gpu_check.json"
    argv = ["gpu_check", "--device", "cpu", "--rows", "1", "2", "--max-tokens", "14", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    gpu_check.main()
    report = json.loads(out.read_text())
    assert report["matches"] and all(report["matches"].values())
    modes = [m for m in gpu_check.MODES if m != "eager"]
    speech_in = {f"step-audio2/{s}/graphs" for s in ("greedy", "sampled")}
    assert set(report["matches"]) == {f"{s}/{m}" for s in ("greedy", "sampled") for m in modes} | speech_in
    for row in report["ms_per_step"].values():
        assert all(row[mode] > 0 for mode in gpu_check.MODES)
    assert report["detok"]["captured"] == 0 and report["detok"]["eager_ms"] > 0  # nothing captured off CUDA

"""loadtest/gpu_bench runs every section end to end on the tiny preset on CPU, so the one prepared GPU
command is ready when a session is lent a device (no timing asserted: the figures come from the GPU)."""

from __future__ import annotations

import json

from loadtest import gpu_bench

TINY_RUN = [
    "--device", "cpu", "--small", "--budget-s", "300",
    "--rows", "1", "2", "--seq-lens", "64", "96", "--paged-rows", "2", "--block-size", "8",
    "--eager-rows", "1", "--eager-seq-len", "64",
    "--max-kv-gb", "0.0003",  # 2 rows x 96 tokens x 2,048 B (orpheus-tiny's KV per token) is over it
    "--snac-chunks", "1", "2",
    "--rates", "4", "--arrival-s", "1", "--rate-cap-s", "10", "--max-tokens", "28", "--batch", "4",
    "--throughput-requests", "2", "--hf-tokens", "7",
]  # fmt: skip


def test_every_section_runs_on_cpu_and_the_table_prints_last(tmp_path, capsys):
    gpu_bench.main([*TINY_RUN, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    for name, *_ in gpu_bench.SECTIONS:
        assert report[name]["ok"] is True, (name, report[name].get("error"))
    assert report["host_syncs_per_step"]["skipped"] == "n/a (cpu)"  # sync debug mode is CUDA's
    assert report["step_profile"]["skipped"] == "n/a (cpu)"
    assert report["attention_check"]["status"] in ("ran", "missing")

    steps = report["decode_step_ms"]["results"]
    cases = {(r["mode"], r["rows"], r["max_seq_len"], r["layout"]) for r in steps}
    assert cases == {("graphs", 1, 64, "slot"), ("graphs", 1, 96, "slot"), ("graphs", 2, 64, "slot"),
                     ("graphs", 2, 96, "slot"), ("graphs", 2, 64, "paged"), ("graphs", 2, 96, "paged"),
                     ("eager", 1, 64, "slot")}  # fmt: skip
    too_large = [r for r in steps if "skipped" in r]
    assert [(r["rows"], r["max_seq_len"]) for r in too_large] == [(2, 96)]  # slot; paged holds only the rows' tokens
    paged = [r for r in steps if r["layout"] == "paged"]
    assert paged[0]["kv_gb"] == paged[1]["kv_gb"] < too_large[0]["kv_gb"]  # the same budget at either length
    assert too_large[0]["skipped"].startswith("kv too large")
    measured = [r for r in steps if "skipped" not in r]
    assert all(r["step_ms"] > 0 and r["tokens_cached"] < 64 for r in measured)  # the same lengths fit every cache
    assert set(report["decode_step_ms"]["ratio_96_over_64"]) == {"1"}
    assert set(report["decode_step_ms"]["paged_ratio_96_over_64"]) == {"2"}

    assert set(report["snac_decode_ms"]["eager_ms"]) == {"1", "2"}
    sweep = report["streaming_sweep"]
    assert len(sweep["c1_ttfa_s"]) == 4 and sweep["c1_warm_ttfa_s"] > 0
    rate = sweep["rates"]["4"]
    assert rate["sent"] == rate["n"] == 4 and rate["p90_ttfa_s"] > 0 and rate["peak_active"] >= 1
    assert rate["pipeline_steps_per_s"] > 0 and 0 < rate["llm_step_ms_p50_p90"][0] <= rate["llm_step_ms_p50_p90"][1]
    assert report["throughput_mode"]["x_real_time"] > 0 and report["naive_hf_generate"]["x_real_time"] > 0

    out = capsys.readouterr().out
    table = out[out.index("=== gpu_bench headline ===") :].splitlines()
    assert any(line.startswith("stream 4/s p90 TTFA s") for line in table)
    assert table[-1].startswith("sections failed: none")


def test_a_failing_section_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch, capsys):
    def broken(run):
        raise RuntimeError("no such kernel")

    sections = (("env", 0.5, gpu_bench.env_section), ("attention_check", 0.6, broken), ("snac_decode_ms", 1.0, broken))
    monkeypatch.setattr(gpu_bench, "SECTIONS", sections)
    report = gpu_bench.main(["--device", "cpu", "--small", "--out", str(tmp_path), "--skip", "snac_decode_ms"])
    assert report["env"]["ok"] is True and "commit" in report["env"]
    assert report["attention_check"]["ok"] is False and "no such kernel" in report["attention_check"]["error"]
    assert report["snac_decode_ms"] == {"skipped": "--skip"}
    assert json.loads((tmp_path / "gpu_bench.json").read_text())["attention_check"]["ok"] is False
    assert capsys.readouterr().out.rstrip().endswith(f"{tmp_path / 'gpu_bench.json'}")

"""`voxray plan`: the table it prints, the sweep, a given cluster, and one-line errors naming the field."""

from __future__ import annotations

import pytest

from cluster.cli import main

CPU_PRESET = ["plan", "--gpu", "cpu", "--model", "orpheus-tiny", "--text-chars", "30", "--ttfa-p90-s", "1.0"]
CPU = [*CPU_PRESET, "--draw-s", "20", "--seeds", "1"]  # short single draws: the CPU preset simulates slowly


def table_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["streams"])
    return [line.split() for line in lines[start + 1 :] if line.strip() and not line.startswith("sources")]


def test_plan_prints_replicas_gpus_ttfa_viability_and_bottleneck(capsys):
    assert main([*CPU, "--streams", "6"]) == 0
    out = capsys.readouterr().out
    assert "orpheus-tiny on cpu" in out and "p90 TTFA <= 1.000 s" in out and "zero-load TTFA" in out
    (row,) = table_rows(out)
    streams, llm, detok, gpus = (int(cell) for cell in row[:4])
    assert streams == 6 and llm >= 1 and detok >= 1 and gpus == llm + detok
    assert float(row[6]) <= 1.0 and float(row[7]) >= 99.0
    assert row[-2] in {"step", "detok", "admission"} and row[-1] == "met"  # "llm step" splits in two


def test_sweep_sizes_each_load_and_needs_more_gpus_for_more_streams(capsys):
    assert main([*CPU, "--sweep", "--sweep-streams", "2", "16"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [int(row[0]) for row in rows] == [2, 16]
    assert int(rows[1][3]) > int(rows[0][3])


def test_a_given_cluster_is_predicted_at_each_load(capsys):
    assert main([*CPU, "--llm-replicas", "1", "--detok-replicas", "1", "--sweep", "--sweep-streams", "2", "30"]) == 0
    light, heavy = table_rows(capsys.readouterr().out)
    assert (light[1], light[2], heavy[1], heavy[2]) == ("1", "1", "1", "1")
    assert light[-1] == "met" and heavy[-1] == "MISSED"


def test_the_start_limit_is_admissions_unless_told(capsys):
    """By default a replica starts `admission.max_starting_per_replica` streams at once, as served; 0 lifts it."""
    given = ["--llm-replicas", "1", "--detok-replicas", "1", "--streams", "2"]
    assert main([*CPU, *given]) == 0
    assert "4 streams starting at once per replica" in capsys.readouterr().out
    assert main([*CPU, *given, "--max-starting", "0"]) == 0
    assert "any number of streams starting at once per replica" in capsys.readouterr().out


def test_a_load_is_judged_on_load_test_draws_unless_told(capsys):
    """By default each draw is 90 s of arrivals from an empty cluster, as the load test measures a rate (the
    shape `loadtest.plan_check` checked against the cluster), and a size is judged on as many draws as hold 2,000
    arrivals; --draw-s 0 takes the steady window, --seeds N that many draws; a given cluster, one draw a load."""
    from cluster.planner.command import PlanRequest, draw_line
    from cluster.planner.simulate import SimOptions

    defaults = PlanRequest(model="orpheus-tiny", gpu="cpu", streams=40, ttfa_p90_s=1.0)
    assert (defaults.seeds, defaults.draw_s) == (0, 90.0)
    assert draw_line(SimOptions(seeds=defaults.seeds, draw_s=defaults.draw_s)) == (
        "Poisson draws per load holding >= 2000 arrivals together (at most 13; most must meet), each 90 s of "
        "arrivals from an empty cluster, all measured (as the load test)"
    )
    given = ["--llm-replicas", "1", "--detok-replicas", "1", "--streams", "2"]
    assert main([*CPU_PRESET, *given]) == 0
    printed = capsys.readouterr()
    assert "1 Poisson draw per load, each 90 s of arrivals from an empty cluster" in printed.out
    assert "voxray plan: 2 streams: 1 LLM + 1 detok replicas (" in printed.err  # progress, load by load
    assert main([*CPU_PRESET, *given, "--draw-s", "0", "--seeds", "3"]) == 0
    assert "1 Poisson draw per load, each a steady window" in capsys.readouterr().out
    assert main([*CPU, "--streams", "2"]) == 0
    assert "1 Poisson draw per load (it must meet), each 20 s" in capsys.readouterr().out


def test_sources_lists_where_the_figures_came_from(capsys):
    assert main([*CPU, "--streams", "2", "--sources"]) == 0
    out = capsys.readouterr().out
    assert "sources:" in out and "policy_sim" in out


def fake_predict(scenario, streams, shape, options):
    """No simulation: a p90 TTFA that grows with a stream's host CPU (0.3 s + the ms as seconds / 100)."""
    from cluster.planner.simulate import Prediction

    p90_s = 0.3 + scenario.calib.host.cpu_ms_per_stream / 100
    return Prediction(p90_s / 2, p90_s, 100.0, 0.0, 0.0, 0.0, 0.5, 0.1, 0.2, 20)


def test_a_calibration_with_a_host_range_adds_the_plans_on_its_cheapest_and_dearest_host(tmp_path, monkeypatch, capsys):
    import json

    from cluster.planner import command
    from cluster.planner.calibration import CALIBRATION_DIR

    monkeypatch.setattr(command, "predict", fake_predict)
    data = json.loads((CALIBRATION_DIR / "cpu-orpheus-tiny.json").read_text())
    host = {"cores": 2, "background_cores": 0.1, "cpu_ms_per_stream": 20, "cpu_ms_per_chunk": 1}
    given = ["--llm-replicas", "1", "--detok-replicas", "1", "--sweep", "--sweep-streams", "2", "4"]
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({**data, "host": host}))
    assert main([*CPU, *given, "--calibration", str(path)]) == 0
    assert "host_range" not in capsys.readouterr().out  # none measured: no line
    spread = {"low": {**host, "cpu_ms_per_stream": 0}, "high": {**host, "cpu_ms_per_stream": 80}}
    path.write_text(json.dumps({**data, "host": host, "host_range": spread}))
    assert main([*CPU, *given, "--calibration", str(path)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == ("host_range (the calibration's measured host spread), at 2 / 4 streams: cheapest host p90 TTFA "
                    "0.300 / 0.300 s (met / met), dearest host p90 TTFA 1.100 / 1.100 s (MISSED / MISSED)")  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--gpu", "h100"], "gpu"),
        (["--model", "csm-1b"], "model"),
        (["--streams", "0"], "streams"),
        (["--ttfa-p90-s", "-0.5"], "ttfa_p90_s"),
        (["--ttfa-p90-s", "0.01"], "ttfa_p90_s"),  # under the zero-load TTFA
        (["--min-viable-pct", "150"], "min_viable_pct"),
        (["--llm-replicas", "2"], "llm_replicas"),
        (["--llm-replicas", "0", "--detok-replicas", "1"], "llm_replicas"),
        (["--text-chars", "0"], "text_chars"),
        (["--step-scale", "0"], "step_scale"),
        (["--sweep", "--sweep-streams", "10", "-5"], "sweep_streams"),
        (["--calibration", "/nonexistent/planner.json"], "calibration"),
        (["--max-starting", "-1"], "max_starting"),
        (["--draw-s", "-1"], "draw_s"),
        (["--seeds", "-1"], "seeds"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(capsys, flags, field):
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {field}: ") and "\n" not in err and "Traceback" not in err


def test_a_non_number_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--streams", "many"])
    assert exit_info.value.code == 2
    assert "--streams" in capsys.readouterr().err

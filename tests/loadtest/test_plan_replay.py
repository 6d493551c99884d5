"""loadtest/plan_replay.py: a served draw's streams become the planner's `Streams` (send order, frames from
their audio, prompts from their text), and the planner replays exactly those arrivals: a burst on a replica
capped at 4 streams queues in the simulation as it did when served, stream by stream. No cluster."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.planner.calibration import CALIBRATION_DIR, load_calibration
from cluster.planner.predict import Scenario
from cluster.planner.search import Slo
from cluster.planner.simulate import SimOptions
from loadtest.plan_configs import CONFIGS, ORPHEUS_TINY, shape_of, sweep_workload
from loadtest.plan_replay import main, replay, replay_verdict, served_streams

FRAME_S = 2048 / 24_000  # SNAC's frame at 24 kHz


def served(at_s: float, ttfa_s: float | None, chars: int = 60, chunks: int = 20) -> dict:
    """One stream as `loop_stalls` keeps it: sent at `at_s`, its chunks' arrivals and audio lengths."""
    arrivals = [] if ttfa_s is None else [ttfa_s + 0.1 * k for k in range(chunks)]
    return {"scheduled_at_s": at_s, "text_chars": chars, "arrivals_s": arrivals,
            "durations_s": [4 * FRAME_S] * len(arrivals), "is_ok": ttfa_s is not None}  # fmt: skip


@pytest.fixture
def scenario() -> Scenario:
    return Scenario(load_calibration(CALIBRATION_DIR / "cpu-orpheus-tiny.json"), ORPHEUS_TINY, sweep_workload())


def test_served_streams_keep_send_order_audio_and_text(scenario):
    streams, ttfa = served_streams([served(12.5, 0.4, chars=100), served(10.0, 0.2, chars=20),
                                    served(11.0, None)], scenario)  # fmt: skip
    assert streams.arrival_s.tolist() == [0.0, 1.0, 2.5]  # from the first send, in send order
    assert streams.frames.tolist() == [80, 1, 80]  # 20 chunks of 4 frames; a stream with no audio keeps a frame
    assert streams.prompt_tokens.tolist() == [5 + 8, 15 + 8, 25 + 8]  # 4 chars a token + the framing
    assert ttfa[0] == pytest.approx(0.2) and np.isinf(ttfa[1]) and ttfa[2] == pytest.approx(0.4)
    assert streams.is_measured.all()


def test_a_burst_queues_on_four_slots_as_served(scenario, tmp_path):
    """Eight short streams sent together to a replica capped at 4: the first four start at once, the next four
    when those end; a stream sent alone afterwards starts at once. Served so (the TTFAs given here), the
    simulated TTFAs of the same arrivals follow them stream by stream."""
    burst = [served(0.001 * k, 0.3 if k < 4 else 1.9, chunks=6) for k in range(8)]
    rows = [*burst, served(40.0, 0.25, chunks=6)]
    streams, ttfa = served_streams(rows, scenario)
    cap4 = next(c for c in CONFIGS if c.name == "cpu-1x1-cap4")
    [result] = replay(scenario, shape_of(cap4), streams, ttfa, seeds=[0])
    assert result["ttfa_correlation"] > 0.9
    assert result["p90_ttfa_s"] > 1.0 and result["queue_wait_p90_s"] > 0.5 and result["p50_ttfa_s"] < 1.0
    (tmp_path / "loop_stalls.json").write_text(json.dumps([{"rate_rps": 0.3, "streams": rows}]))
    calibration = tmp_path / "calibration.json"
    calibration.write_text((CALIBRATION_DIR / "cpu-orpheus-tiny.json").read_text())
    out = main(["--calibration", str(calibration), "--loop-stalls", str(tmp_path / "loop_stalls.json"),
                "--config", "cpu-1x1-cap4", "--seeds", "0"])  # fmt: skip
    assert out[0]["p90_ttfa_s"] == result["p90_ttfa_s"] and out[0]["served_p90_ttfa_s"] == pytest.approx(1.9)


def test_the_planner_calls_a_served_draw_on_its_own_arrivals(scenario):
    """The same eight-stream burst on a replica capped at 4 misses a 1 s p90 in every seed (the second four
    wait for the first); spread out one every 10 s, the same streams meet it. The majority stops once decided."""
    cap4 = shape_of(next(c for c in CONFIGS if c.name == "cpu-1x1-cap4"))
    burst = [served(0.001 * k, 0.3, chunks=20) for k in range(8)]
    apart = [served(10.0 * k, 0.3, chunks=20) for k in range(8)]
    slo, sim = Slo(1.0), SimOptions(seeds=3)
    missed, met = replay_verdict(scenario, cap4, burst, slo, sim), replay_verdict(scenario, cap4, apart, slo, sim)
    assert missed["met"] is False and len(missed["p90_ttfa_s"]) == 2 and min(missed["p90_ttfa_s"]) > 1.0
    assert met["met"] is True and len(met["p90_ttfa_s"]) == 2 and max(met["p90_ttfa_s"]) < 1.0
    assert min(met["viable_pct"]) == 100.0


def test_a_plan_check_sweep_is_replayed_again_from_its_json(scenario, tmp_path):
    """`--check-json`: a plan_check sweep's kept draws (with their streams) replayed at the calibration's speed
    and at each draw's own: the capacity the planner calls over the swept rates and the draws it calls as served."""
    light = [served(10.0 * k, 0.3, chunks=20) for k in range(4)]
    burst = [served(0.001 * k, 0.3, chunks=20) for k in range(8)]
    steps = [{"summary": {"rate_rps": 0.1}, "draw": 0, "met": True, "requests": light, "box_step_ms": 3.0},
             {"summary": {"rate_rps": 0.8}, "draw": 0, "met": True, "requests": burst, "box_step_ms": 3.0}]  # fmt: skip
    (tmp_path / "cpu-1x1-cap4.json").write_text(json.dumps({"steps": steps}))
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({**json.loads((CALIBRATION_DIR / "cpu-orpheus-tiny.json").read_text()),
                                       "box_speed": {"step_ms": 3.0}}))  # fmt: skip
    out = main(["--calibration", str(calibration), "--check-json", str(tmp_path / "cpu-1x1-cap4.json"),
                "--config", "cpu-1x1-cap4", "--seeds", "0", "1", "2"])  # fmt: skip
    assert [row["replay"] for row in out] == ["replay", "replay_at_draw_speed"]
    for row in out:  # the burst misses a 1 s p90 on 4 slots where it was served as met
        assert row["capacity_rps"] == 0.1 and not row["is_floor"] and row["agreement"] == 0.5


def test_a_saved_fixed_draws_check_gets_its_crossings_again(scenario, tmp_path, capsys):
    """`--check-json --planner-draws`: the planner's own sweep-shaped draws at the swept rates, at the calibration's
    speed and at each rate's draws' (steps x2 here), beside the served draws' crossing; written beside the check."""
    light = [served(10.0 * k, 0.3, chunks=20) for k in range(4)]
    burst = [served(0.001 * k, 0.3, chunks=20) for k in range(8)]  # misses a 1 s p90 on 4 slots
    steps = [{"summary": {"rate_rps": rate}, "draw": 0, "met": met, "requests": requests, "box_step_ms": 6.0}
             for rate, met, requests in ((0.2, True, light), (6.0, False, burst))]  # fmt: skip
    kept = {"met": False, "p90_ttfa_s": [9.0], "viable_pct": [50.0]}  # replays the check wrote: kept, not run again
    steps[0] |= {"replay": kept, "replay_at_draw_speed": {**kept, "scale": 2.0}}
    check = {"steps": steps, "draws": 1, "config": {"rates_rps": [0.2, 6.0], "duration_s": 20.0, "max_requests": 128}}
    (tmp_path / "cpu-1x1-cap4.json").write_text(json.dumps(check))
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({**json.loads((CALIBRATION_DIR / "cpu-orpheus-tiny.json").read_text()),
                                       "box_speed": {"step_ms": 3.0}}))  # fmt: skip
    main(["--calibration", str(calibration), "--check-json", str(tmp_path / "cpu-1x1-cap4.json"),
          "--config", "cpu-1x1-cap4", "--seeds", "0", "--planner-draws", "2"])  # fmt: skip
    written = json.loads((tmp_path / "planner_draws_again.json").read_text())
    assert written["scales"] == {"0.2": 2.0, "6.0": 2.0}
    assert [d["met"] for d in written["calibration_speed"]["0.2"]] == [True, True]
    assert [d["met"] for d in written["draws_speed"]["6.0"]] == [False, False]
    table = capsys.readouterr().out.split("| config |")[1]
    row = next(line for line in table.splitlines() if line.startswith("| cpu-1x1-cap4 |"))
    served_crossing = row.split(" | ")[3]
    assert served_crossing == "3.10"  # met at 0.2, missed at 6.0: halfway
    assert row.endswith("| < 0.20 | < 0.20 | 1 / 2 |")  # the light draw's replays as the check wrote them (missed)

"""Calibrate the capacity planner on this box: write the calibration JSON `voxray plan` / `plan_check` read.

Measurements only, none of them the planner-vs-cluster check (issue 40 item 3): (1) the CPU preset's LLM step
alone by rows (`loadtest.step_bench.ms_per_step`); (2) a served 1x1 `voxray serve` (`loadtest.host_cost`):
c=1 streams in two prompt sets (every process's CPU: the detok replica's per chunk), three idle spells (the
idle background), two rounds of closed-loop clients at 2-12 (the LLM replica's serving-loop step by rows, and
the host's CPU against the streams and chunks each level served: its cost per start and per chunk at load;
the spells' and the rounds' spread as `host_range`, the cheapest and dearest host); (3) an idle 2x2 server
(the idle background's part per stage replica); (4) the box's speed before and after (`box_speed`: the
Python unit and the LLM step at 4 rows; this VM's cores change speed by minutes, and `plan_check`
compares its draws' speed with it). The JSON carries,
beside each number's source, the `assumptions` it rests on and the c=1 TTFA against the planner's zero-load
TTFA on it. Starts Ray (unless --no-host): never beside another benchmark. Takes about 5 min (host_cost's
part about 4, a minute more than before its spells and rounds were repeated).
Usage: python -m loadtest.plan_calibrate --out bench_out/plan_calibration.json [--cores 2]
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from cluster.planner.calibration import CALIBRATION_DIR, parse_calibration
from loadtest.box_speed import box_step_ms, box_units_per_s
from loadtest.host_fit import HostCost, calibration_host, calibration_host_range

CPU_CALIBRATION = CALIBRATION_DIR / "cpu-orpheus-tiny.json"
CALIBRATION_ROWS = (1, 2, 4, 8, 12)
ASSUMPTIONS = (
    "every stage replica and the host's processes share `host.cores` cores by processor sharing (one "
    "runnable thread a busy replica); the idle server takes `host.background_cores` + "
    "`host.background_cores_per_replica` a stage replica (idle 1x1 and 2x2 servers; the 1x1's the mean of "
    "its idle spells)",
    "the host (Router, proxy, controller, GCS, raylet, the client) costs `host.cpu_ms_per_stream` a stream "
    "and `host.cpu_ms_per_chunk` a chunk (fitted over every round's closed-loop levels together), spread "
    "over 0.2 s; `host_range` holds the cheapest and dearest host the idle spells and the rounds' own fits "
    "measured (the spread of one calibration, not a bound)",
    "the LLM step is the serving loop's mean cycle by rows under closed-loop load, from its loop trace (its "
    "contention at those loads is in it; the planner's core share slows it again: the two may overlap); each "
    "simulated step is drawn x a spell's factor and a step's from `llm.step_spread` (the same cycles over "
    "their size's mean, pooled over sizes): spells independent of each other, steps within one too",
    "the detokenizer's batch cost is the table's shape scaled to the replica's CPU per chunk at c=1",
    "hops and the chunk schedule as in the base file; one cache column (no cache-length dependence on CPU)",
)


def measured_step_ms(rows: tuple[int, ...] = CALIBRATION_ROWS, max_tokens: int = 200) -> dict[int, float]:
    """The CPU preset's decode step on this box now, by rows (what `loadtest.step_bench` prints)."""
    import torch

    from core.config import ModelConfig
    from llm_stage.models.orpheus import OrpheusAdapter
    from loadtest.step_bench import ms_per_step

    torch.set_num_threads(1)
    adapter = OrpheusAdapter.build(ModelConfig(torch_threads=1))
    return {n: ms_per_step(adapter, n, max_tokens, align_starts=True) for n in rows}


def calibration_with_steps(base: dict, step_ms_by_rows: dict[int, float], source: str) -> dict:
    """A copy of `base` whose LLM step table is `step_ms_by_rows` (one cache column), source noted."""
    data = copy.deepcopy(base)
    rows = sorted(step_ms_by_rows)
    column = data["llm"]["step_ms"]["cache_tokens"]
    data["llm"]["step_ms"] = {"rows": rows, "cache_tokens": column, "ms": [[step_ms_by_rows[n]] for n in rows]}
    data["sources"]["llm.step_ms"] = source
    return data


def serving_loop_line(step_ms_by_rows: dict[int, float]) -> tuple[float, float] | None:
    """(ms at 0 rows, ms per row): a least-squares line through the serving loop's step by rows; None with
    fewer than 3 sizes measured."""
    if len(step_ms_by_rows) < 3:
        return None
    rows = np.asarray(list(step_ms_by_rows), np.float64)
    slope, intercept = np.polyfit(rows, np.asarray(list(step_ms_by_rows.values())), 1)
    return max(0.0, float(intercept)), max(0.0, float(slope))


def serving_loop_table(step_ms_by_rows: dict[int, float], top: int) -> dict[int, float] | None:
    """The serving loop's step by rows as the planner's table: the measured sizes (a size never cheaper
    than a smaller one: a few noisy steps must not make a batch cheaper than the one below it), carried on
    to `top` rows along the line's slope through them; None with fewer than 3 sizes measured. Not a line
    alone: on CPU a step's fixed cost (the policy, chunk cutting, the loop) is most of a small batch's."""
    line = serving_loop_line(step_ms_by_rows)
    if line is None:
        return None
    rows = sorted(step_ms_by_rows)
    ms = np.maximum.accumulate([step_ms_by_rows[n] for n in rows])
    table = {n: round(float(v), 3) for n, v in zip(rows, ms, strict=True)}
    if top > rows[-1]:
        table[top] = round(float(ms[-1]) + line[1] * (top - rows[-1]), 3)
    return table


def calibration_with_host(data: dict, cost: HostCost, cores: int, source: str) -> dict:
    """A copy of `data` (its step table measured alone on this box) with what the served cluster measured
    (`cost`): the LLM step as the serving loop measured it by rows under closed-loop load (`serving_loop_table`:
    it adds what the engine alone does not: the policy, chunk cutting, the replica's other threads), else
    the engine's table x the serving loop's CPU per token at one row over it; the detok table scaled to the
    replica's CPU per chunk at c=1; the host's CPU as the `host` section (`calibration_host`) and, where the
    measurement spread, `host_range` beside it (`calibration_host_range`)."""
    out = copy.deepcopy(data)
    calib = parse_calibration(data)
    one_row_ms = float(calib.llm_step.step_ms(np.ones(1), np.full(1, float(calib.llm_step.cache_tokens[0])))[0])
    sources = out["sources"]
    top = max(calib.max_streams_per_replica, max(cost.loaded_step_ms_by_rows, default=0))
    table = serving_loop_table(cost.loaded_step_ms_by_rows, top)
    if table is not None:
        column = out["llm"]["step_ms"]["cache_tokens"]
        out["llm"]["step_ms"] = {"rows": list(table), "cache_tokens": column, "ms": [[ms] for ms in table.values()]}
        out["llm"]["pipeline_step_factor"] = 1.0
        alone_table = data["llm"]["step_ms"]
        alone = ", ".join(f"{r}: {ms[0]:.2f}" for r, ms in zip(alone_table["rows"], alone_table["ms"], strict=True))
        sources["llm.step_ms"] = (f"{source}: the LLM replica's serving loop under closed-loop load, each batch "
                                  f"size's mean cycle (gap + step) in its loop trace, never below a smaller size's, "
                                  f"past the largest along the line through them; the engine alone (step_bench) "
                                  f"{alone} ms")  # fmt: skip
        if cost.loaded_step_spread:
            out["llm"]["step_spread"] = cost.loaded_step_spread
            sources["llm.step_spread"] = (f"{source}: the same decode-only cycles over their size's mean, pooled: "
                                          f"the means of {cost.loaded_step_spread['spell_s']} s spells and the "
                                          f"cycles within them (loadtest.loop_stalls.cycle_spread)")  # fmt: skip
    else:
        out["llm"]["pipeline_step_factor"] = round(max(1.0, cost.llm_ms_per_token / one_row_ms), 3)
        sources["llm.pipeline_step_factor"] = (
            f"{source}: the LLM replica's CPU per token at one row "
            f"{cost.llm_ms_per_token:.2f} ms / the step alone {one_row_ms:.2f} ms"
        )
    table_ms = float(np.mean(calib.detok.batch_ms(np.asarray(cost.detok_windows, np.float64))))
    detok_factor = cost.detok_ms_per_chunk / table_ms if table_ms > 0 else 1.0
    out["detok"]["ms"] = [round(ms * detok_factor, 3) for ms in data["detok"]["ms"]]
    out["host"] = calibration_host(cost, cores)
    add_host_range(out, cost, cores, source)
    sources["detok"] = (
        f"{data['sources'].get('detok', '')}; scaled x{detok_factor:.2f} to the detok replica's "
        f"CPU per chunk, {cost.detok_ms_per_chunk:.1f} ms ({source})"
    )
    out["sources"]["host"] = (f"{source}: CPU of every other process of the server and the client, fitted over the "
                              f"closed-loop levels; the idle background the idle spells' mean")  # fmt: skip
    return out


def add_host_range(data: dict, cost: HostCost, cores: int, source: str) -> None:
    """Write `host_range` (`calibration_host_range`) and its source into `data` where the measurement spread."""
    host_range = calibration_host_range(cost, cores)
    if host_range is None:
        return
    data["host_range"] = host_range
    spells, rounds = len(cost.background_samples), len({level.round for level in cost.levels})
    data["sources"]["host_range"] = (f"{source}: the cheapest (low) and dearest (high) host over {spells} idle "
                                     f"spells and {rounds} rounds' own fits of the closed-loop levels "
                                     f"(loadtest.host_fit.calibration_host_range)")  # fmt: skip


def calibrate(serve_cfg, scratch: Path, cores: int, host_requests: int, use_host: bool = True,
              idle_cfg=None) -> tuple[dict, HostCost | None]:  # fmt: skip
    """The calibration for this box now (`serve_cfg`: the 1x1 `core.config.ServeConfig` host_cost serves;
    `idle_cfg`: a larger cluster served idle, for the background's part per replica) and the host
    measurement it came from (None with `use_host` False: every stage on its own core)."""
    speeds, step_probes = [box_units_per_s()], [box_step_ms()]
    steps = measured_step_ms()
    base = json.loads(CPU_CALIBRATION.read_text())
    data = calibration_with_steps(base, steps, f"loadtest.step_bench.ms_per_step on this box, rows {CALIBRATION_ROWS}")
    cost = None
    if use_host:
        from loadtest.host_cost import idle_background, measure

        cost = measure(serve_cfg, scratch, host_requests)
        if idle_cfg is not None:
            replicas = idle_cfg.llm.num_replicas + idle_cfg.detok.num_replicas
            idle = idle_background(idle_cfg, scratch / "idle")
            cost = replace(cost, background_by_replicas={**cost.background_by_replicas, replicas: idle})
        data = calibration_with_host(data, cost, cores, "loadtest.host_cost on this box")
    speeds.append(box_units_per_s())
    step_probes.append(box_step_ms())
    data["box_speed"] = {"units_per_s": round(float(np.mean(speeds)), 2), "probes": [round(v, 2) for v in speeds],
                         "step_ms": round(float(np.mean(step_probes)), 3),
                         "step_probes": [round(v, 3) for v in step_probes]}  # fmt: skip
    return data, cost


def with_assumptions(data: dict, cost: HostCost | None, zero_load_ttfa_s: float) -> dict:
    """`data` with its `assumptions` and the c=1 check: measured TTFA p50 (short set) vs the planner's
    zero-load TTFA on this calibration; the gap is a start's latency the model leaves out (not added)."""
    out = copy.deepcopy(data)
    out["assumptions"] = list(ASSUMPTIONS if cost is not None else ASSUMPTIONS[3:])
    if cost is not None:
        out["c1_check"] = {"measured_ttfa_p50_s": round(cost.ttfa_p50_s, 4),
                           "planner_zero_load_ttfa_s": round(zero_load_ttfa_s, 4),
                           "unmodelled_start_latency_s": round(cost.ttfa_p50_s - zero_load_ttfa_s, 4)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    from cluster.planner.predict import Scenario
    from cluster.planner.search import zero_load_ttfa_s
    from loadtest.host_fit import report
    from loadtest.plan_configs import CONFIGS, ORPHEUS_TINY, serve_config, sweep_workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/plan_calibration.json"))
    parser.add_argument("--cores", type=int, default=2, help="the cores every process of the box shares")
    parser.add_argument("--host-requests", type=int, default=12, help="streams in each of host_cost's two sets")
    parser.add_argument("--no-host", action="store_true", help="the step alone (no Ray): stages on their own cores")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    scratch = args.out.with_suffix("")
    data, cost = calibrate(serve_config(CONFIGS[0], 19312, 19313), scratch, args.cores, args.host_requests,
                           use_host=not args.no_host, idle_cfg=serve_config(CONFIGS[1], 19312, 19313))  # fmt: skip
    if cost is not None:
        scratch.mkdir(parents=True, exist_ok=True)
        (scratch / "host_cost.json").write_text(json.dumps(asdict(cost), indent=2))
        print(report(cost))
    zero_s = zero_load_ttfa_s(Scenario(parse_calibration(data), ORPHEUS_TINY, sweep_workload()))
    data = with_assumptions(data, cost, zero_s)
    args.out.write_text(json.dumps(data, indent=2))
    sections = ("llm", "detok", "host", "host_range")
    print(json.dumps({k: data[k] for k in sections if k in data} | {"c1": data.get("c1_check")}))
    print(f"calibration written to {args.out}")
    return data


if __name__ == "__main__":
    main()

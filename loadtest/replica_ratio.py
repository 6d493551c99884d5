"""Capacity at SLO per LLM : detok replica ratio: for each ratio, `loadtest.serve_voxray` serves the
base config with those replica counts (and `--model`), then `loadtest.sweep` runs its open-loop rate
sweep against it. Writes one sweep JSON per ratio and a markdown table of capacity and peak audio.
Usage: python -m loadtest.replica_ratio --model cosyvoice2-tiny --ratios 1:1 1:2 2:1 --rates 0.25 0.5 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import yaml

from core.config import load_serve_config
from loadtest.run_all import System, start_ready, stop
from loadtest.serve_voxray import CPU_CONFIG
from loadtest.sweep import SweepConfig, run_sweep, write_result


def parse_ratio(text: str) -> tuple[int, int]:
    llm, sep, detok = text.partition(":")
    if not sep or not llm.isdigit() or not detok.isdigit() or int(llm) < 1 or int(detok) < 1:
        raise argparse.ArgumentTypeError(f"--ratios: {text!r} is not LLM:DETOK replica counts such as 1:2")
    return int(llm), int(detok)


def ratio_config(base: Path, model: str, llm: int, detok: int, out: Path) -> Path:
    """The base Serve config with `model` and fixed replica counts, written as YAML under `out`."""
    config = load_serve_config(base)
    engine = config.engine.model_copy(update={"model": config.engine.model.model_copy(update={"name": model})})
    config = config.model_copy(
        update={
            "engine": engine,
            "llm": config.llm.model_copy(update={"autoscaling": False, "num_replicas": llm}),
            "detok": config.detok.model_copy(update={"autoscaling": False, "num_replicas": detok}),
        }
    )
    path = out / f"serve_{model}_{llm}x{detok}.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def run_ratio(args: argparse.Namespace, cfg: SweepConfig, llm: int, detok: int) -> dict:
    config_path = ratio_config(args.config, args.model, llm, detok, args.out)
    label = f"{args.model}-{llm}x{detok}"
    command = [sys.executable, "-m", "loadtest.serve_voxray", "--grpc-port", str(args.grpc_port),
               "--http-port", str(args.grpc_port + 1), "--config", str(config_path)]  # fmt: skip
    system = System(label, args.grpc_port, command, 300.0)
    started = time.monotonic()
    proc = start_ready(system, args.out, cfg.app_name, voice=cfg.voice)
    try:
        target = f"127.0.0.1:{args.grpc_port}"
        startup_s = time.monotonic() - started
        result = run_sweep(target, cfg, label)
    finally:
        stop(proc)
    write_result(result, args.out)
    steps = [step["summary"] for step in result.steps]
    peak = max((step["summary"]["audio_s"] / max(step["wall_s"], 1e-9) for step in result.steps), default=0.0)
    return {"llm": llm, "detok": detok, "capacity_rps": result.capacity_rps, "startup_s": round(startup_s, 1),
            "steps": steps, "peak_audio_x": round(peak, 3)}  # fmt: skip


def report(rows: list[dict]) -> str:
    lines = ["| LLM : detok | capacity at SLO (req/s) | peak audio (x RT) | per rate: p90 TTFA / viable |",
             "|---|---|---|---|"]  # fmt: skip
    for row in rows:
        cells = ", ".join(
            f"{s['rate_rps']:g}: {'-' if s['ttfa_p90_s'] is None else format(s['ttfa_p90_s'], '.2f')} s / "
            f"{s['pct_viable']:.0f}%"
            for s in row["steps"]
        )
        lines.append(f"| {row['llm']}:{row['detok']} | {row['capacity_rps']:g} | {row['peak_audio_x']:.2f} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="served model name, e.g. cosyvoice2-tiny")
    p.add_argument("--ratios", type=parse_ratio, nargs="+", default=[(1, 1), (1, 2), (2, 1)])
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-requests", type=int, default=40)
    p.add_argument("--slo-ttfa-p90-s", type=float, default=1.0)
    p.add_argument("--config", type=Path, default=CPU_CONFIG, help="base Serve config (default: the CPU one)")
    p.add_argument("--grpc-port", type=int, default=19150, help="the server's gRPC port (HTTP: the next one)")
    p.add_argument("--out", type=Path, default=Path("bench_out/replica_ratio"))
    args = p.parse_args(argv)
    from llm_stage.registry import get_entry

    entry = get_entry(args.model)
    cfg = SweepConfig(
        rates_rps=tuple(args.rates), duration_s=args.duration_s, min_requests=args.min_requests,
        max_requests=args.max_requests, slo_ttfa_p90_s=args.slo_ttfa_p90_s,
    )  # fmt: skip
    cfg = replace(cfg, voice=entry.default_voice or "", frame_rate_hz=entry.family.frame_rate_hz,
                  steps_per_frame=entry.family.lm.steps_per_frame)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for llm, detok in args.ratios:
        rows.append(run_ratio(args, cfg, llm, detok))
        print(f"[{args.model} {llm}:{detok}] capacity at SLO {rows[-1]['capacity_rps']:g} req/s", flush=True)
    (args.out / "replica_ratio.json").write_text(json.dumps({"config": asdict(cfg), "ratios": rows}, indent=1) + "\n")
    markdown = report(rows)
    (args.out / "replica_ratio.md").write_text(markdown)
    print(markdown)
    return rows


if __name__ == "__main__":
    main()

"""One command for the whole load comparison: VoxRay, the vLLM official-stack baseline and the naive
transformers baseline, one after another on loopback, same weights, prompts, rates and harness.

Writes <out>/<system>.json, plots, summary.json and summary.md (capacity ratios). `make sweep`.
Usage: python -m loadtest.run_all --out loadtest/results
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.metrics import RateSummary, capacity_at_slo
from loadtest.plots import plot_all
from loadtest.server_start import start_until_serving, wait_serving
from loadtest.sweep import SweepConfig, run_sweep

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CPU_RATES = (0.1, 0.2, 0.4, 0.8, 1.6)
CPU_SLO_TTFA_P90_S = 1.0
RELAXED_TTFA_S = (2.5, 5.0)


@dataclass(frozen=True)
class System:
    label: str
    port: int
    command: list[str]
    ready_timeout_s: float


def systems(weights: Path) -> dict[str, System]:
    py = sys.executable
    return {
        "voxray": System("voxray", 19110, [py, "-m", "loadtest.serve_voxray", "--grpc-port", "19110",
                                           "--http-port", "19111"], 240.0),
        "vllm": System("vllm", 19120, [str(VLLM_PYTHON), "-m", "loadtest.baselines.vllm_server",
                                       "--weights", str(weights), "--port", "19120"], 420.0),
        "naive": System("naive", 19130, [py, "-m", "loadtest.baselines.naive_server", "--weights", str(weights),
                                         "--port", "19130"], 180.0),
    }  # fmt: skip


def start(system: System, log_dir: Path) -> subprocess.Popen:
    """The system's server process in a new session, its log `<log_dir>/<label>.server.log`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log_path(system, log_dir).open("w") as log:
        return subprocess.Popen(system.command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip


def log_path(system: System, log_dir: Path) -> Path:
    return log_dir / f"{system.label}.server.log"


def start_ready(system: System, log_dir: Path, app_name: str, voice: str = "tara") -> subprocess.Popen:
    """`start`, then wait until it streams audio: its exit before that fails at once with its log's end,
    a Ray start that timed out is started once more (`loadtest.server_start`)."""
    target = f"127.0.0.1:{system.port}"

    def wait(proc: subprocess.Popen) -> None:
        wait_serving(proc, log_path(system, log_dir), target, app_name, system.ready_timeout_s, voice=voice)

    return start_until_serving(lambda: start(system, log_dir), wait, stop, label=system.label)


def stop(proc: subprocess.Popen, grace_s: float = 45.0) -> None:
    """SIGTERM the server (it shuts its own Ray / engine down), then SIGKILL its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def run_system(system: System, cfg: SweepConfig, out_dir: Path) -> dict:
    started = time.monotonic()
    log_dir = ROOT / "bench_out" / "sweep-logs"  # server logs stay out of the committed results
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = start_ready(system, log_dir, cfg.app_name)
    try:
        target = f"127.0.0.1:{system.port}"
        startup_s = time.monotonic() - started
        result = run_sweep(target, cfg, system.label)
    finally:
        stop(proc)
    data = asdict(result)
    data.update(startup_s=round(startup_s, 1), loadavg_1m_after=os.getloadavg()[0])
    (out_dir / f"{system.label}.json").write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    return data


def summaries_of(result: dict) -> list[RateSummary]:
    return [RateSummary(**step["summary"]) for step in result["steps"]]


def ratio(ours: float, theirs: float) -> str:
    if theirs > 0:
        return f"{ours / theirs:.1f}x"
    return "n/a (both 0)" if ours == 0 else "inf (baseline 0)"


def step_wall_s(step: dict) -> float:
    """Wall time of a rate step (recorded, or rebuilt from its requests' send times and last chunks)."""
    if "wall_s" in step:
        return step["wall_s"]
    ends = [r["scheduled_at_s"] + r["send_lag_s"] + max(r["arrivals_s"], default=0.0) for r in step["requests"]]
    return max(ends, default=0.0)


def peak_audio_throughput_x(result: dict) -> float:
    """Best audio seconds delivered per wall second over the rate steps (a saturation measure)."""
    return max((s["summary"]["audio_s"] / max(step_wall_s(s), 1e-9) for s in result["steps"]), default=0.0)


def relaxed_capacities(result: dict, thresholds_s: tuple[float, ...] = RELAXED_TTFA_S) -> dict[str, float]:
    """Highest rate with p90 TTFA <= each threshold, viability ignored (diagnostic, not the headline)."""
    return {f"{t:g}": capacity_at_slo(summaries_of(result), t, min_pct_viable=0.0) for t in thresholds_s}


def summary_rows(results: list[dict], slo_s: float) -> list[dict]:
    rows = []
    for r in results:
        first = r["steps"][0]["summary"] if r["steps"] else {}
        rows.append({
            "system": r["label"], "capacity_rps": capacity_at_slo(summaries_of(r), slo_s),
            "ttfa_only_capacity_rps": capacity_at_slo(summaries_of(r), slo_s, min_pct_viable=0.0),
            "max_rate_swept": max((s["summary"]["rate_rps"] for s in r["steps"]), default=0.0),
            "lowest_rate": first.get("rate_rps"), "p90_ttfa_s_at_lowest": first.get("ttfa_p90_s"),
            "pct_viable_at_lowest": first.get("pct_viable"), "speed_x_at_lowest": first.get("stream_speed_p50_x"),
            "startup_s": r.get("startup_s"), "sweep_wall_s": r.get("wall_s"),
            "peak_audio_throughput_x": peak_audio_throughput_x(r), "relaxed_capacity_rps": relaxed_capacities(r),
        })  # fmt: skip
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_markdown(rows: list[dict]) -> str:
    """Headline table (capacity at SLO) and a diagnostic table (relaxed TTFA, throughput), VoxRay ratios."""
    ours = next((r for r in rows if r["system"] == "voxray"), None)
    relaxed = list(rows[0]["relaxed_capacity_rps"]) if rows else []
    head = ["system", "capacity at SLO (req/s)", "VoxRay ratio", "p90 TTFA @ lowest rate (s)", "% viable @ lowest",
            "stream speed @ lowest (x RT)"]  # fmt: skip
    diag = ["system", *(f"rate @ p90 TTFA <= {t} s (req/s)" for t in relaxed), "peak audio throughput (x RT)",
            "VoxRay throughput ratio"]  # fmt: skip
    lines = [_row(head), _row(["---"] * len(head))]
    for r in rows:
        cap = ratio(ours["capacity_rps"], r["capacity_rps"]) if ours and r is not ours else "-"
        lines.append(_row([r["system"], f"{r['capacity_rps']:g}", cap, _fmt(r["p90_ttfa_s_at_lowest"], ".2f"),
                           _fmt(r["pct_viable_at_lowest"], ".0f"), _fmt(r["speed_x_at_lowest"], ".2f")]))  # fmt: skip
    lines += ["", _row(diag), _row(["---"] * len(diag))]
    for r in rows:
        thr = ratio(ours["peak_audio_throughput_x"], r["peak_audio_throughput_x"]) if ours and r is not ours else "-"
        caps = [f"{r['relaxed_capacity_rps'][t]:g}" for t in relaxed]
        lines.append(_row([r["system"], *caps, f"{r['peak_audio_throughput_x']:.2f}", thr]))
    return "\n".join(lines) + "\n"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("loadtest/results"))
    p.add_argument("--weights", type=Path, default=Path("build/loadtest-weights"))
    p.add_argument("--systems", nargs="+", choices=["voxray", "vllm", "naive"], default=["voxray", "vllm", "naive"])
    p.add_argument("--rates", type=float, nargs="+", default=list(CPU_RATES))
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--min-requests", type=int, default=6)
    p.add_argument("--slo-ttfa-p90-s", type=float, default=CPU_SLO_TTFA_P90_S)
    p.add_argument("--process", choices=["poisson", "gamma"], default="poisson")
    p.add_argument("--summarize-only", action="store_true", help="rebuild plots and tables from <out>/*.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    cfg = SweepConfig(rates_rps=tuple(args.rates), duration_s=args.duration_s, min_requests=args.min_requests,
                      slo_ttfa_p90_s=args.slo_ttfa_p90_s, process=args.process)  # fmt: skip
    if args.summarize_only:
        results = [json.loads((args.out / f"{name}.json").read_text()) for name in args.systems]
    else:
        results = run_systems(args, cfg)
    plot_all(results, args.out, args.slo_ttfa_p90_s)
    rows = summary_rows(results, args.slo_ttfa_p90_s)
    summary = {"slo_ttfa_p90_s": args.slo_ttfa_p90_s, "config": asdict(cfg), "nproc": os.cpu_count(), "rows": rows}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    markdown = summary_markdown(rows)
    (args.out / "summary.md").write_text(markdown)
    print(markdown)
    return results


def run_systems(args: argparse.Namespace, cfg: SweepConfig) -> list[dict]:
    from loadtest.baselines.export_weights import export_all

    export_all(args.weights)
    args.out.mkdir(parents=True, exist_ok=True)
    table = systems(args.weights.resolve())
    return [run_system(table[name], cfg, args.out) for name in args.systems]


if __name__ == "__main__":
    main()

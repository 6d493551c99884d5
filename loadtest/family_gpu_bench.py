"""Every served family at its published size on one GPU: one command, one JSON, one table.

Entries (`loadtest.family_shapes`, random weights made once per entry): CSM 1B + Mimi, Dia 1.6B + DAC 44.1 kHz,
Qwen3-TTS 0.6B and 1.7B + the 12 Hz decoder, CosyVoice 2 0.5B + S3Gen, Chatterbox (T3 + S3Gen), parallel heads
on a Qwen3-1.7B body with 8 X-Codec streams. Per entry, each section within its share of the entry's time
(`--budget-s` split evenly: fewer rates or cases per family when short, never fewer families): the GPU check
(graphs give eager's tokens, greedy and seeded, CFG pairs included), decode step ms (eager vs graphs) per rows,
the detokenizer's cost per second of audio per batch, the in-process pipeline (c=1 TTFA, one stream's
x-real-time, Poisson rates, capacity at p90 TTFA <= 500 ms and >= 99% viable), throughput mode, and CFG
retention for Dia and Chatterbox. CosyVoice 2 also runs `voxserve_setting` (`loadtest.family_voxserve`: its
capacity at VoxServe's sampling, one voice and 15-token chunks, 100% viable) in a fixed `--voxserve-s` taken
off the shared budget first. DIR/family_gpu_bench.json is rewritten after each section.
GPU (~8 min): `make gpu-wheels`, then on the GPU machine, carrying `.whl`:
    VOXRAY_COMMIT=$(git rev-parse --short HEAD) BENCH=family_gpu_bench OUT=$OUT bash loadtest/gpu_run.sh
CPU smoke: `.venv/bin/python -m loadtest.family_gpu_bench --device cpu --small --out /tmp/fgb`
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

import llm_stage.registry as registry
from core.config import ModelConfig
from detok_stage.codecs.base import CodecAdapter
from llm_stage.models.base import LMAdapter
from loadtest.family_sections import (
    cfg_section,
    detok_section,
    parity_section,
    step_ms_section,
    streaming_section,
    throughput_section,
)
from loadtest.family_shapes import ENTRY_NAMES, FamilyEntry, entry_named, patched_all, presets_on, published_shapes
from loadtest.family_voxserve import ENTRY as VOXSERVE_ENTRY
from loadtest.family_voxserve import headline as voxserve_headline
from loadtest.family_voxserve import voxserve_section
from loadtest.gpu_bench import run_environment

SECTIONS: tuple[tuple[str, float, Callable], ...] = (  # name, end as a share of the entry's time, body
    ("gpu_check", 0.07, parity_section),
    ("step_ms", 0.33, step_ms_section),
    ("detok_cost", 0.40, detok_section),
    ("streaming", 0.84, streaming_section),  # c=1, one stream, then rates of `rate_needs_s` each
    ("throughput", 0.92, throughput_section),
    ("cfg_retention", 1.0, cfg_section),
)
# name, the entry it runs for, the argument naming its seconds (taken off `--budget-s` before the split), body
FIXED_SECTIONS: tuple[tuple[str, str, str, Callable], ...] = (
    ("voxserve_setting", VOXSERVE_ENTRY, "voxserve_s", voxserve_section),
)
MIN_SECTION_S = 3.0  # a section late because an earlier one overran still gets this long


@dataclass
class FamilyRun:
    """One entry's run: its arguments, clock, the adapter and codec every section shares (built once, on the
    device), and its part of the report. Duck-types `gpu_bench.BenchRun` for the helpers reused from there."""

    args: argparse.Namespace
    entry: FamilyEntry
    report: dict
    start_s: float = field(default_factory=time.monotonic)
    deadline_s: float = math.inf
    adapter: LMAdapter | None = None
    codec: CodecAdapter | None = None

    @property
    def is_cuda(self) -> bool:
        return self.args.device.startswith("cuda")

    @property
    def frame_s(self) -> float:
        return self.codec.frame_duration_s

    @property
    def steps_per_frame(self) -> float:
        return self.adapter.steps_per_frame

    def model_config(self) -> ModelConfig:
        dtype = "bfloat16" if self.is_cuda else "float32"
        return ModelConfig(name=self.entry.model, device=self.args.device, dtype=dtype)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start_s

    def time_left_s(self) -> float:
        return self.deadline_s - time.monotonic()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def say(self, text: str) -> None:
        print(f"[{self.elapsed_s():6.1f}s] {text}", flush=True)


def build_on_device(run: FamilyRun) -> None:
    """The adapter and codec; on a GPU their random weights are made there (`family_shapes.presets_on`)."""
    config, entry = run.model_config(), registry.get_entry(run.entry.model)
    with patched_all(presets_on(run.args.device)) if run.is_cuda else nullcontext():
        run.adapter, run.codec = entry.build_lm(config), entry.build_codec(config, run.args.device)


def weights_gb(run: FamilyRun) -> dict[str, float]:
    def size(module: object) -> float:
        params = getattr(module, "parameters", None)
        return round(sum(p.numel() * p.element_size() for p in params()) / 1e9, 3) if params else 0.0

    lm_modules = [m for m in vars(run.adapter).values() if isinstance(m, torch.nn.Module)]
    codec_modules = [m for m in vars(run.codec).values() if isinstance(m, torch.nn.Module)]
    lm_gb = sum(size(m) for m in {id(m): m for m in lm_modules}.values())
    return {"lm_gb": round(lm_gb, 3), "codec_gb": round(sum(size(m) for m in codec_modules), 3)}


def family_args(args: argparse.Namespace, run: FamilyRun) -> argparse.Namespace:
    """The pipeline helpers' arguments for this entry: `max_tokens` = `--stream-audio-s` of its audio."""
    steps_per_s = run.steps_per_frame / run.frame_s
    return argparse.Namespace(**{**vars(args), "max_tokens": max(4, round(args.stream_audio_s * steps_per_s))})


def cached_builds(run: FamilyRun) -> list:
    """Pipelines built inside this entry get the run's adapter and codec instead of new random weights."""
    return [
        (registry.ModelEntry, "build_lm", lambda _self, _config: run.adapter),
        (registry.ModelEntry, "build_codec", lambda _self, _config, _device: run.codec),
    ]


def fixed_sections(args: argparse.Namespace, key: str | None = None) -> list[tuple[str, str, str, Callable]]:
    """The fixed-time sections this run makes (of entry `key` only, when given)."""
    return [f for f in FIXED_SECTIONS if f[1] in args.entries and f[0] not in args.skip and key in (None, f[1])]


def entry_budget_s(args: argparse.Namespace) -> float:
    """Each entry's share of `--budget-s`, once the fixed sections' seconds are taken off."""
    fixed = sum(getattr(args, seconds) for _, _, seconds, _ in fixed_sections(args))
    return max(0.0, args.budget_s - fixed) / len(args.entries)


def run_section(run: FamilyRun, name: str, deadline_s: float, body: Callable[[FamilyRun], dict]) -> dict:
    run.deadline_s = max(deadline_s, time.monotonic() + MIN_SECTION_S)
    if name in run.args.skip:
        return {"skipped": "--skip"}
    start = time.monotonic()
    try:
        data = {"ok": True, **body(run)}
    except Exception as err:  # recorded; the next section runs
        data = {"ok": False, "error": repr(err)[:1500], "trace": traceback.format_exc()[-3000:]}
    data["section_s"] = round(time.monotonic() - start, 1)
    release_memory(run)
    return data


def release_memory(run: FamilyRun) -> None:
    gc.collect()
    if run.is_cuda:
        torch.cuda.empty_cache()


def run_sections(run: FamilyRun, save: Callable[[], None]) -> None:
    """The shared sections by their end shares of the entry's budget, then the entry's fixed-time ones."""
    budget_s = entry_budget_s(run.args)
    for name, end_share, body in SECTIONS:
        record_section(run, name, run.start_s + end_share * budget_s, body, save)
    for name, _, seconds, body in fixed_sections(run.args, run.entry.key):
        record_section(run, name, time.monotonic() + getattr(run.args, seconds), body, save)


def record_section(run: FamilyRun, name: str, deadline_s: float, body: Callable, save: Callable[[], None]) -> None:
    run.report[name] = run_section(run, name, deadline_s, body)
    save()
    run.say(f"{run.entry.key} {name}: {json.dumps(brief(run.report[name]), default=str)[:300]}")


def run_entry(args: argparse.Namespace, entry: FamilyEntry, report: dict, save: Callable[[], None]) -> None:
    """Build `entry` at its published sizes (the tiny preset with --small), then its sections into `report`."""
    report |= {"model": entry.model, "sizes": "tiny preset (--small)" if args.small else entry.sizes}
    run = FamilyRun(args, entry, report)
    try:
        with nullcontext() if args.small else published_shapes(entry):
            build_on_device(run)
            report["build_s"], report["weights"] = round(run.elapsed_s(), 1), weights_gb(run)
            run.args = family_args(args, run)
            run.say(f"{entry.key}: built in {report['build_s']} s, {report['weights']}")
            with patched_all(cached_builds(run)):
                run_sections(run, save)
    except Exception as err:  # the build failed: the next family runs
        report["error"] = repr(err)[:1500]
        report["trace"] = traceback.format_exc()[-3000:]
    finally:
        run.adapter = run.codec = None
        release_memory(run)
    report["entry_s"] = round(run.elapsed_s(), 1)


def brief(data: dict) -> dict:
    return {k: v for k, v in data.items() if k != "trace"}


# --- the table -----------------------------------------------------------------------------------------------


def step_at(report: dict, mode: str, rows: int) -> float | None:
    for row in report.get("step_ms", {}).get("results", []):
        if row["mode"] == mode and row["rows"] == rows:
            return row.get("step_ms")
    return None


def table_row(key: str, report: dict, args: argparse.Namespace) -> list[str]:
    streaming, cfg = report.get("streaming", {}), report.get("cfg_retention", {}).get("by_streams", {})
    detok = report.get("detok_cost", {}).get("by_batch", {})
    biggest = str(max(args.detok_batches))
    cells = [step_at(report, "eager", min(args.rows)), step_at(report, "graphs", min(args.rows)),
             step_at(report, "graphs", max(args.rows)), streaming.get("c1_warm_ttfa_s"),
             streaming.get("one_stream", {}).get("x_rt"), report.get("throughput", {}).get("x_real_time"),
             detok.get(biggest, {}).get("ms_per_audio_s"), streaming.get("capacity_at_slo_rps"),
             report.get("voxserve_setting", {}).get("capacity_at_slo_rps"),
             max((v.get("retention") or 0 for v in cfg.values()), default=None)]  # fmt: skip
    return [key, *("-" if c is None else f"{c:.4g}" for c in cells), str(report.get("gpu_check", {}).get("ok", "-"))]


def print_table(report: dict, args: argparse.Namespace, total_s: float) -> None:
    lo, hi, batch = min(args.rows), max(args.rows), max(args.detok_batches)
    head = ["family", f"eager{lo}", f"graph{lo}", f"graph{hi}", "c1 TTFA", "1-str xRT", "tput xRT",
            f"detok ms/s@{batch}", "cap rps", "vxs cap", "cfg ret", "parity"]  # fmt: skip
    lines = ["  ".join(f"{h:>10s}" for h in head)]
    for key in args.entries:
        lines.append("  ".join(f"{c:>10s}" for c in table_row(key, report["families"].get(key, {}), args)))
    lines.append(
        f"step ms at rows; c1 TTFA s (warm); detok ms per second of audio; cap rps: p90 TTFA <= 0.5 s, "
        f">= 99% viable; vxs cap: VoxServe's setting, 100% viable; total {total_s:.0f} s"
    )
    vxs = voxserve_headline(report)
    if vxs:
        lines.append(vxs)
    print("\n=== family_gpu_bench ===\n" + "\n".join(lines), flush=True)


# --- arguments -----------------------------------------------------------------------------------------------

GPU_DEFAULTS = {"rows": [1, 16, 64, 128], "eager_rows": [1, 16, 64, 128], "detok_batches": [1, 16, 64],
                "rates": [2.0, 4.0, 8.0], "cfg_streams": [16, 64, 128], "voxserve_rates": [4.0, 8.0, 12.0],
                "voxserve_s": 50.0}  # fmt: skip
SMALL_DEFAULTS = {"rows": [1, 2], "eager_rows": [1, 2], "detok_batches": [1, 2], "rates": [1.0],
                  "cfg_streams": [2], "budget_s": 60.0, "stream_audio_s": 0.6, "arrival_s": 1.0,
                  "rate_cap_s": 4.0, "throughput_requests": 2, "cfg_tokens": 16, "c1_repeats": 2,
                  "detok_window_s": 0.3, "detok_repeats": 1, "batch": 8, "voxserve_rates": [1.0],
                  "voxserve_s": 20.0}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder of family_gpu_bench.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="the tiny presets, small loads (CI's smoke test)")
    p.add_argument("--entries", nargs="+", default=list(ENTRY_NAMES), choices=ENTRY_NAMES, metavar="ENTRY")
    sections = [name for name, *_ in SECTIONS] + [name for name, *_ in FIXED_SECTIONS]
    p.add_argument("--skip", nargs="+", default=[], choices=sections, metavar="SECTION")
    p.add_argument("--budget-s", type=float, help="wall time all entries share, evenly (default 420)")
    p.add_argument("--rows", type=int, nargs="+", help="decode step batch rows, graphs")
    p.add_argument("--eager-rows", type=int, nargs="+", help="decode step batch rows, eager too")
    p.add_argument("--detok-batches", type=int, nargs="+")
    p.add_argument("--detok-window-s", type=float, help="audio per decoded window (default 1.0)")
    p.add_argument("--detok-repeats", type=int)
    p.add_argument("--rates", type=float, nargs="+", help="Poisson req/s, lowest first")
    p.add_argument("--arrival-s", type=float, help="arrivals per rate last this long (default 4)")
    p.add_argument("--rate-cap-s", type=float, help="wall time per rate at most (default 15)")
    p.add_argument("--stream-audio-s", type=float, help="audio per stream, sets max_tokens (default 5)")
    p.add_argument("--batch", type=int, help="pipeline max_batch_size (default 128)")
    p.add_argument("--throughput-requests", type=int, help="default 128")
    p.add_argument("--cfg-streams", type=int, nargs="+")
    p.add_argument("--cfg-tokens", type=int, help="steps per stream in the CFG runs (default 64)")
    p.add_argument("--c1-repeats", type=int, help="lone requests timed for c=1 TTFA (default 3)")
    p.add_argument("--voxserve-rates", type=float, nargs="+", help="voxserve_setting's req/s (default 4 8 12)")
    p.add_argument("--voxserve-s", type=float, help="voxserve_setting's seconds, off --budget-s (default 50)")
    p.add_argument("--voxserve-chunk-tokens", type=int, default=15, help="voxserve_setting's chunk (VoxServe: 15)")
    args = p.parse_args(argv)
    defaults = {"budget_s": 420.0, "detok_window_s": 1.0, "detok_repeats": 5, "arrival_s": 4.0, "rate_cap_s": 15.0,
                "stream_audio_s": 5.0, "batch": 128, "throughput_requests": 128, "cfg_tokens": 64, "c1_repeats": 3,
                **GPU_DEFAULTS, **(SMALL_DEFAULTS if args.small else {})}  # fmt: skip
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    fixed = {"slots": 0, "max_seq_len": 1024, "startup_concurrency": 8, "prompt_room": 192,
             "parity_tokens": 24, "parity_streams": 4}  # fmt: skip
    return argparse.Namespace(**{**fixed, **vars(args)})


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --device cpu --small for the smoke test")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    env = {**run_environment(args.device), "model": "tiny presets" if args.small else "published sizes, random weights"}
    report: dict = {"env": env, "budget_s": args.budget_s, "families": {}}
    path = args.out / "family_gpu_bench.json"

    def save() -> None:
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(report, indent=1, default=str))
        scratch.replace(path)

    for key in args.entries:
        report["families"][key] = {}
        run_entry(args, entry_named(key), report["families"][key], save)
        save()
    print_table(report, args, time.monotonic() - start)
    return report


if __name__ == "__main__":
    main()

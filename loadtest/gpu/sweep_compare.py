"""The GPU load sweep's figures: per-rate rows of the in-process pipeline and of the Serve cluster, capacity at SLO
for each TTFA target, their ratio, and one JSON + markdown table of both. Pure functions over rows, plus a CLI
that loadtest/gpu/sweep_run.sh calls last with the two drivers' JSON (loadtest.gpu.inprocess_sweep,
loadtest.gpu.cluster_sweep). DESIGN §1: capacity at SLO = the highest swept rate, every lower one meeting it too,
with p90 TTFA <= the SLO and >= 99% viable; here over admitted streams, with at most `max_refused_pct` refused.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.metrics import RequestRecord, highest_rate_meeting, is_viable, percentile, ttfa_s

SLOS_S = (0.5, 0.3)  # p90 TTFA targets: VoxServe's 500 ms and the 300 ms
MIN_PCT_VIABLE = 99.0
MAX_REFUSED_PCT = 1.0  # more refused than this and the rate is not served, however well the admitted ones play
# A stream answered with one of these before any audio was refused by admission, not admitted.
REFUSAL_CODES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"})
CAPPED = "CAPPED"  # the rate's time cap cut the stream (the client cancelled it): admitted, not viable


@dataclass
class StreamResult:
    """One cluster stream as the client saw it: send / end (s since the rate began), chunk arrivals (s since its
    send) with their audio seconds, and how it ended (a gRPC status name, or CAPPED)."""

    sent_s: float
    ended_s: float = 0.0
    arrivals_s: list[float] = field(default_factory=list)
    durations_s: list[float] = field(default_factory=list)
    code: str = "OK"
    hops_s: list[list[float]] = field(default_factory=list)  # per chunk, seconds on each of loadtest.metrics.HOPS

    @property
    def is_refused(self) -> bool:
        return self.code in REFUSAL_CODES and not any(d > 0 for d in self.durations_s)

    def record(self) -> RequestRecord:
        return RequestRecord(arrivals_s=self.arrivals_s, durations_s=self.durations_s, is_ok=self.code == "OK",
                             error="" if self.code == "OK" else self.code, hops_s=self.hops_s)  # fmt: skip


@dataclass(frozen=True)
class RateRow:
    """One rate of one system. TTFA and viability are over admitted streams; an admitted stream that failed or
    played nothing counts as never starting (p90 None when that reaches the 90th percentile)."""

    rate_rps: float
    sent: int = 0
    admitted: int = 0
    refused: int = 0
    p50_ttfa_s: float | None = None
    p90_ttfa_s: float | None = None
    pct_viable: float | None = None  # of admitted
    peak_streams: int = 0  # streams open at once (admitted; in-process: held by the engine)
    audio_x_rt: float = 0.0  # audio seconds delivered per wall second of the rate
    reject_p50_ms: float | None = None
    reject_p99_ms: float | None = None
    wall_s: float = 0.0
    capped: bool = False  # the rate's time cap ended it with streams still playing
    errors: dict[str, int] = field(default_factory=dict)
    skipped: str = ""  # why the rate did not run (out of time, saturated below)

    @property
    def pct_refused(self) -> float:
        return 100.0 * self.refused / self.sent if self.sent else 0.0


def finite_or_none(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or math.isinf(value) else round(value, digits)


def peak_open(spans: list[tuple[float, float]]) -> int:
    """Most (start, end) spans open at one time."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    peak = current = 0
    for _, step in edges:
        current += step
        peak = max(peak, current)
    return peak


def cluster_row(rate_rps: float, streams: list[StreamResult], wall_s: float) -> RateRow:
    admitted = [s for s in streams if not s.is_refused]
    ttfas = [ttfa_s(s.arrivals_s, s.durations_s) if s.code == "OK" else None for s in admitted]
    ttfas = [math.inf if t is None else t for t in ttfas]
    reject_ms = [1e3 * (s.ended_s - s.sent_s) for s in streams if s.is_refused]
    errors: dict[str, int] = {}
    for s in streams:
        if s.code != "OK":
            errors[s.code] = errors.get(s.code, 0) + 1
    audio_s = sum(sum(d for d in s.durations_s if d > 0) for s in admitted)
    return RateRow(
        rate_rps=rate_rps, sent=len(streams), admitted=len(admitted), refused=len(streams) - len(admitted),
        p50_ttfa_s=finite_or_none(percentile(ttfas, 50)), p90_ttfa_s=finite_or_none(percentile(ttfas, 90)),
        pct_viable=round(100.0 * sum(is_viable(s.record()) for s in admitted) / len(admitted), 1) if admitted else None,
        peak_streams=peak_open([(s.sent_s, s.ended_s) for s in admitted]),
        audio_x_rt=round(audio_s / wall_s, 1) if wall_s > 0 else 0.0,
        reject_p50_ms=finite_or_none(percentile(reject_ms, 50), 1),
        reject_p99_ms=finite_or_none(percentile(reject_ms, 99), 1),
        wall_s=round(wall_s, 1), capped=any(s.code == CAPPED for s in streams), errors=errors,
    )  # fmt: skip


def playback_row(
    rate_rps: float, ttfas_s: list[float | None], viable: list[bool], peak_streams: int, audio_s: float, wall_s: float,
    capped: bool,
) -> RateRow:  # fmt: skip
    """The in-process pipeline's rate (no admission: every stream admitted) from each stream's TTFA (None: it never
    played, counted as never starting) and viability (finished, never ran dry)."""
    ttfas = [math.inf if t is None else t for t in ttfas_s]
    return RateRow(
        rate_rps=rate_rps, sent=len(ttfas), admitted=len(ttfas),
        p50_ttfa_s=finite_or_none(percentile(ttfas, 50)), p90_ttfa_s=finite_or_none(percentile(ttfas, 90)),
        pct_viable=round(100.0 * sum(viable) / len(viable), 1) if viable else None, peak_streams=peak_streams,
        audio_x_rt=round(audio_s / wall_s, 1) if wall_s > 0 else 0.0, wall_s=round(wall_s, 1), capped=capped,
    )  # fmt: skip


def meets_slo(row: RateRow, slo_s: float, max_refused_pct: float | None = MAX_REFUSED_PCT) -> bool:
    """p90 TTFA <= slo_s and >= 99% of admitted viable; with `max_refused_pct`, at most that share refused."""
    if row.skipped or not row.admitted or row.p90_ttfa_s is None or row.pct_viable is None:
        return False
    refused_ok = max_refused_pct is None or row.pct_refused <= max_refused_pct
    return row.p90_ttfa_s <= slo_s and row.pct_viable >= MIN_PCT_VIABLE and refused_ok


def capacity_rps(rows: list[RateRow], slo_s: float, max_refused_pct: float | None = MAX_REFUSED_PCT) -> float:
    """The highest swept rate meeting the SLO with every lower swept rate meeting it too; 0 if none."""
    return highest_rate_meeting(rows, lambda row: meets_slo(row, slo_s, max_refused_pct))


def served_rps(rows: list[RateRow], slo_s: float) -> float:
    """Admitted streams per second at the highest rate whose admitted streams meet the SLO (refusals allowed)."""
    rate = capacity_rps(rows, slo_s, max_refused_pct=None)
    row = next((r for r in rows if r.rate_rps == rate), None)
    return round(rate * row.admitted / row.sent, 2) if row is not None and row.sent else 0.0


def is_saturated(row: RateRow, stop_p90_ttfa_s: float) -> bool:
    """Higher rates would only queue or refuse more: p90 past the ceiling, under half viable, or most refused."""
    if row.skipped:
        return True
    slow = row.p90_ttfa_s is None or row.p90_ttfa_s > stop_p90_ttfa_s
    return slow or (row.pct_viable or 0.0) < 50.0 or row.pct_refused > 75.0


def rows_from(data: dict) -> list[RateRow]:
    return [RateRow(**row) for row in data.get("rows", [])]


def row_at(rows: list[RateRow], rate_rps: float) -> RateRow | None:
    return next((r for r in rows if r.rate_rps == rate_rps), None)


def ratio(cluster: float, inprocess: float) -> float | None:
    return round(cluster / inprocess, 2) if inprocess > 0 else None


def headline(inprocess: list[RateRow], cluster: list[RateRow]) -> dict:
    """Capacity at each SLO for both systems, the cluster / in-process ratio, and the figures at capacity."""
    out: dict = {}
    for slo_s in SLOS_S:
        key = f"{round(slo_s * 1000)}ms"
        ip, cl = capacity_rps(inprocess, slo_s), capacity_rps(cluster, slo_s)
        at_ip, at_cl = row_at(inprocess, ip), row_at(cluster, cl)
        out[key] = {
            "inprocess_capacity_rps": ip, "cluster_capacity_rps": cl, "cluster_over_inprocess": ratio(cl, ip),
            "cluster_capacity_refusals_allowed_rps": capacity_rps(cluster, slo_s, max_refused_pct=None),
            "cluster_served_rps": served_rps(cluster, slo_s),
            "inprocess_peak_streams": at_ip.peak_streams if at_ip else 0,
            "cluster_peak_streams": at_cl.peak_streams if at_cl else 0,
            "inprocess_audio_x_rt": at_ip.audio_x_rt if at_ip else 0.0,
            "cluster_audio_x_rt": at_cl.audio_x_rt if at_cl else 0.0,
        }  # fmt: skip
    rejects = [r.reject_p99_ms for r in cluster if r.reject_p99_ms is not None]
    out["cluster_reject_p99_ms_worst"] = max(rejects) if rejects else None
    out["peak_streams_max"] = {"inprocess": max((r.peak_streams for r in inprocess), default=0),
                               "cluster": max((r.peak_streams for r in cluster), default=0)}  # fmt: skip
    out["audio_x_rt_max"] = {"inprocess": max((r.audio_x_rt for r in inprocess), default=0.0),
                             "cluster": max((r.audio_x_rt for r in cluster), default=0.0)}  # fmt: skip
    return out


def compare(inprocess: dict, cluster: dict, env: dict) -> dict:
    """One report from the two drivers' JSON (each with `rows`; the in-process one with `hf_generate`)."""
    ip_rows, cl_rows = rows_from(inprocess), rows_from(cluster)
    return {"env": env, "headline": headline(ip_rows, cl_rows),
            "c1_warm_ttfa_s": {"inprocess": inprocess.get("c1_warm_ttfa_s"), "cluster": cluster.get("c1_warm_ttfa_s")},
            "hf_generate": inprocess.get("hf_generate"), "inprocess": inprocess, "cluster": cluster}  # fmt: skip


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _num(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:g}{unit}"


def rate_line(system: str, row: RateRow) -> str:
    if row.skipped:
        return f"| {row.rate_rps:g} | {system} | skipped: {row.skipped} |||||||||"
    reject = "-" if row.reject_p50_ms is None else f"{row.reject_p50_ms:.0f} / {row.reject_p99_ms:.0f}"
    marks = " ".join(f"{round(s * 1000)}:{'yes' if meets_slo(row, s) else 'no'}" for s in SLOS_S)
    return (f"| {row.rate_rps:g} | {system} | {row.sent} | {row.refused} | {_ms(row.p50_ttfa_s)} "
            f"| {_ms(row.p90_ttfa_s)} | {_num(row.pct_viable)} | {row.peak_streams} | {row.audio_x_rt:g}x | {reject} "
            f"| {marks}"
            f"{' (capped)' if row.capped else ''} |")  # fmt: skip


def markdown(report: dict) -> str:
    env, head = report["env"], report["headline"]
    ip, cl = report["inprocess"], report["cluster"]
    lines = [
        "## GPU load sweep: in-process pipeline vs the Serve cluster, same GPU, same weights, one run", "",
        f"{env.get('gpu')}, commit {env.get('commit')}, torch {env.get('torch')}, Ray {env.get('ray')}, "
        f"{env.get('date_utc')}; model {env.get('model')}; config {env.get('config')}; "
        f"{ip.get('audio_s_per_stream')} s streams, Poisson arrivals for {ip.get('arrival_s')} s per rate; "
        f"cluster requests carry a TTFA deadline of {cluster_deadline(cl)}.", "",
        "| figure | in-process | Serve cluster | cluster / in-process |", "|---|---|---|---|",
    ]  # fmt: skip
    for key, h in ((k, v) for k, v in head.items() if k.endswith("ms")):
        lines.append(f"| capacity at SLO, p90 TTFA <= {key[:-2]} ms, >= 99% viable, <= {MAX_REFUSED_PCT:g}% refused "
                     f"| {h['inprocess_capacity_rps']:g} req/s | {h['cluster_capacity_rps']:g} req/s "
                     f"| {_num(h['cluster_over_inprocess'], 'x')} |")  # fmt: skip
        lines.append(
            f"| at that rate: peak concurrent streams / audio x real time | {h['inprocess_peak_streams']} / "
            f"{h['inprocess_audio_x_rt']:g}x | {h['cluster_peak_streams']} / {h['cluster_audio_x_rt']:g}x | |"
        )
        lines.append(
            f"| cluster, refusals allowed ({key[:-2]} ms): capacity / admitted req/s | | "
            f"{h['cluster_capacity_refusals_allowed_rps']:g} / {h['cluster_served_rps']:g} | |"
        )
    c1 = report["c1_warm_ttfa_s"]
    hf = report.get("hf_generate") or {}
    lines += [
        f"| c=1 TTFA, warm | {_ms(c1['inprocess'])} | {_ms(c1['cluster'])} | |",
        f"| peak concurrent streams, any rate | {head['peak_streams_max']['inprocess']} | "
        f"{head['peak_streams_max']['cluster']} | |",
        f"| audio x real time, any rate | {head['audio_x_rt_max']['inprocess']:g}x | "
        f"{head['audio_x_rt_max']['cluster']:g}x | |",
        f"| reject latency p99, worst rate | | {_num(head['cluster_reject_p99_ms_worst'], ' ms')} | |",
        f"| naive baseline: HF generate(), one stream, {hf.get('tokens', '-')} tokens (LLM only) | "
        f"{_num(hf.get('x_real_time'), 'x')} real time | | |", "",
        "| rate req/s | system | sent | refused | p50 TTFA | p90 TTFA | % viable (admitted) | peak streams "
        "| audio x RT | reject p50 / p99 ms | meets 500 / 300 ms |", "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    ip_rows, cl_rows = rows_from(ip), rows_from(cl)
    for rate in sorted({r.rate_rps for r in ip_rows + cl_rows}):
        for system, rows in (("in-process", ip_rows), ("cluster", cl_rows)):
            row = row_at(rows, rate)
            lines.append(rate_line(system, row) if row else f"| {rate:g} | {system} | not run |||||||||")
    return "\n".join(lines) + "\n"


def cluster_deadline(cluster: dict) -> str:
    deadline = cluster.get("ttfa_deadline_s")
    return "the server's default" if not deadline else f"{deadline:g} s"


def environment(config: str, model: str) -> dict:
    """Where the figures come from (imports torch and Ray only here: the CLI runs last, on the GPU machine)."""
    import torch

    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (rehearsal)"
    return {"gpu": gpu, "torch": torch.__version__, "ray": ray_version, "commit": os.environ.get("VOXRAY_COMMIT"),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "config": config, "model": model}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inprocess", type=Path, required=True, help="loadtest.gpu.inprocess_sweep's JSON")
    p.add_argument("--cluster", type=Path, required=True, help="loadtest.gpu.cluster_sweep's JSON")
    p.add_argument("--extra", type=Path, action="append", default=[], help="JSON files kept under `runs` by name")
    p.add_argument("--config", default="", help="the served config (recorded)")
    p.add_argument("--model", default="", help="what the weights are (recorded)")
    p.add_argument("--out", type=Path, required=True, help="writes OUT/gpu_sweep.json and OUT/gpu_sweep.md")
    args = p.parse_args(argv)
    load = lambda path: json.loads(path.read_text()) if path.is_file() else {"rows": [], "missing": str(path)}  # noqa: E731
    report = compare(load(args.inprocess), load(args.cluster), environment(args.config, args.model))
    report["runs"] = {path.stem: load(path) for path in args.extra}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_sweep.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    table = markdown(report)
    (args.out / "gpu_sweep.md").write_text(table)
    print(table, flush=True)
    return report


if __name__ == "__main__":
    main()

"""The soak's samples and verdict, as pure functions over a time series (`loadtest.soak` records it;
tests/loadtest/test_soak.py feeds synthetic ones). A sample maps series names to values:
`rss_mb/<process>`, `fds/<process>`, `object_store_mb`, `object_store_objects`, `num_processes` and
the VoxRay gauges `gauge/<name>`. Nothing may grow past warm-up: each resource series' level (median
over a window) at the end of the load within 5% of its level at warm-up, above a small absolute floor
per kind; processes may not come or go; the stream gauges read zero at the end of the idle tail.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass

# Counts that must read zero once the cluster is idle (the realtime factor is a rate, not a count).
IDLE_ZERO_GAUGES = ("gauge/ray_voxray_active_streams", "gauge/ray_voxray_kv_slots_used", "gauge/ray_voxray_queue_depth")
# Growth under this much is noise whatever the percentage (a few fds for connections, allocator pages).
ABSOLUTE_FLOORS = {"rss_mb/": 2.0, "fds/": 3.0, "object_store_mb": 1.0, "object_store_objects": 5.0,
                   "num_processes": 0.0}  # fmt: skip
GROWTH_PREFIXES = tuple(ABSOLUTE_FLOORS)


@dataclass(frozen=True)
class Sample:
    t_s: float  # since the soak's start
    phase: str  # "load" while arrivals are sent, then "idle"
    values: dict[str, float]


@dataclass(frozen=True)
class Growth:
    series: str
    at_warm_up: float
    at_end: float
    growth_pct: float | None  # (end - warm-up) / warm-up, in % (None: zero at warm-up)
    allowed: float  # the larger of tolerance_pct of the warm-up level and the series' absolute floor
    ok: bool


def process_series(label: str, rss_bytes: int, num_fds: int) -> dict[str, float]:
    return {f"rss_mb/{label}": rss_bytes / 2**20, f"fds/{label}": float(num_fds)}


def gauge_series(metrics: dict[str, float]) -> dict[str, float]:
    """The scraped VoxRay gauges (counters and histograms grow by nature) and the object store's use."""
    out = {f"gauge/{name}": value for name, value in metrics.items()
           if name.startswith("ray_voxray_") and not re.search(r"_(total|count|sum|bucket)$", name)}  # fmt: skip
    if "ray_object_store_used_memory" in metrics:
        out["object_store_mb"] = metrics["ray_object_store_used_memory"] / 2**20
    if "ray_object_store_num_local_objects" in metrics:
        out["object_store_objects"] = metrics["ray_object_store_num_local_objects"]
    return out


def level(samples: list[Sample], series: str, start_s: float, end_s: float) -> float | None:
    """Median of the series over samples with start_s <= t < end_s (None: no sample has it)."""
    values = [s.values[series] for s in samples if start_s <= s.t_s < end_s and series in s.values]
    return statistics.median(values) if values else None


def floor_of(series: str) -> float:
    return next(floor for prefix, floor in ABSOLUTE_FLOORS.items() if series.startswith(prefix))


def growths(samples: list[Sample], warm_up_s: float, load_end_s: float, window_s: float,
            tolerance_pct: float = 5.0) -> list[Growth]:  # fmt: skip
    """Each resource series' level at the end of the load against its level at warm-up, worst first.
    A series missing at either end (a process that came or went) is `process_changes`' business."""
    names = sorted({name for s in samples for name in s.values if name.startswith(GROWTH_PREFIXES)})
    out = []
    for name in names:
        start = level(samples, name, warm_up_s, warm_up_s + window_s)
        end = level(samples, name, load_end_s - window_s, load_end_s)
        if start is None or end is None:
            continue
        allowed = max(abs(start) * tolerance_pct / 100.0, floor_of(name))
        pct = round(100.0 * (end - start) / start, 2) if start else None
        out.append(Growth(name, round(start, 3), round(end, 3), pct, round(allowed, 3), end - start <= allowed))
    return sorted(out, key=lambda g: (g.ok, -(g.at_end - g.at_warm_up - g.allowed)))


def process_changes(samples: list[Sample], warm_up_s: float) -> dict[str, list[str]]:
    """Processes that appeared or went away after warm-up (a leak of workers, or a crashed replica)."""

    def processes(sample: Sample) -> set[str]:
        return {name.split("/", 1)[1] for name in sample.values if name.startswith("rss_mb/")}

    after = [s for s in samples if s.t_s >= warm_up_s]
    if not after:
        return {"appeared": [], "gone": []}
    first, seen = processes(after[0]), set().union(*(processes(s) for s in after))
    last = processes(after[-1])
    return {"appeared": sorted(seen - first), "gone": sorted(first - last)}


def idle_gauges(samples: list[Sample]) -> dict[str, float | None]:
    """Each stream gauge's last scraped value (None: never scraped). Ray 2.60 drops a gauge series
    from the endpoint ~2 export intervals after its last `set`, so an idle cluster's gauges may be
    gone by the end of the tail: the value they had when last reported stands (a stale 1 included)."""
    out: dict[str, float | None] = {}
    for name in IDLE_ZERO_GAUGES:
        seen = [s.values[name] for s in samples if name in s.values]
        out[name] = seen[-1] if seen else None
    return out


def verdict(samples: list[Sample], warm_up_s: float, load_end_s: float, window_s: float,
            tolerance_pct: float = 5.0) -> dict:  # fmt: skip
    """Flat after warm-up, no process came or went, gauges back to zero when idle."""
    grown = growths(samples, warm_up_s, load_end_s, window_s, tolerance_pct)
    changes = process_changes(samples, warm_up_s)
    gauges = idle_gauges(samples)
    gauges_zero = all(value == 0 for value in gauges.values())
    last = samples[-1].values if samples else {}
    is_flat = all(g.ok for g in grown) and not changes["appeared"] and not changes["gone"]
    return {
        "ok": is_flat and gauges_zero, "flat": is_flat, "gauges_zero_when_idle": gauges_zero,
        "worst": asdict(grown[0]) if grown else None, "grown": [asdict(g) for g in grown if not g.ok],
        "series_checked": len(grown), "processes": changes, "idle_gauges": gauges,
        "gauges_scraped_at_end": sorted(name for name in last if name.startswith("gauge/")),
        "warm_up_s": warm_up_s, "load_end_s": load_end_s, "window_s": window_s, "tolerance_pct": tolerance_pct,
    }  # fmt: skip

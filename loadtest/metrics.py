"""DESIGN §1 load-test metrics as pure functions over client-side chunk arrival lists.

TTFA, per-chunk lateness, streaming viability, worst underrun, per-rate summaries and
capacity at SLO. Used by `loadtest.sweep`, the Locust user and their unit tests; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TypeVar

R = TypeVar("R")  # a per-rate row with a `rate_rps`


@dataclass
class RequestRecord:
    """One request as the client saw it: chunk arrivals (s since send) and audio per chunk (s)."""

    arrivals_s: list[float] = field(default_factory=list)
    durations_s: list[float] = field(default_factory=list)
    is_ok: bool = True  # the stream ended with status OK
    error: str = ""
    scheduled_at_s: float = 0.0  # intended send time, relative to the start of its rate step
    send_lag_s: float = 0.0  # actual send - intended send (client-side queueing)
    text_chars: int = 0
    hops_s: list[list[float]] = field(default_factory=list)  # per chunk, seconds on each of HOPS


# A chunk's path through the cluster, from the server's wall-clock stamps and the client's receipt.
HOPS = ("llm -> detok", "detok queue + decode", "detok -> router -> proxy", "proxy -> client")


def chunk_hops_s(stamps_unix_s: tuple[float, float, float, float], received_unix_s: float) -> list[float] | None:
    """Seconds on each of HOPS for one chunk: stamps = (chunk ready, detok received, audio ready,
    router sent); None when a stage did not stamp it (a baseline server)."""
    points = [*stamps_unix_s, received_unix_s]
    if min(stamps_unix_s) <= 0:
        return None
    return [b - a for a, b in zip(points, points[1:], strict=False)]


def hop_breakdown(records: list[RequestRecord]) -> dict[str, dict[str, float]]:
    """p50 / p90 milliseconds of each hop over every stamped chunk of `records`."""
    columns = list(zip(*[h for r in records for h in r.hops_s], strict=False))
    return {
        name: {"p50_ms": 1000 * (percentile(list(col), 50) or 0.0), "p90_ms": 1000 * (percentile(list(col), 90) or 0.0)}
        for name, col in zip(HOPS, columns, strict=False)
    }


def audio_chunks(arrivals_s: list[float], durations_s: list[float]) -> list[tuple[float, float]]:
    """(arrival, duration) of the chunks that carry audio; empty chunks have nothing to play."""
    return [(t, d) for t, d in zip(arrivals_s, durations_s, strict=True) if d > 0]


def ttfa_s(arrivals_s: list[float], durations_s: list[float]) -> float | None:
    """Send -> first non-empty chunk; None when no audio arrived."""
    chunks = audio_chunks(arrivals_s, durations_s)
    return chunks[0][0] if chunks else None


def chunk_lateness_s(arrivals_s: list[float], durations_s: list[float]) -> list[float]:
    """Per audio chunk i >= 1: t_i - t0 - audio received before it (> 0 means the player starved)."""
    chunks = audio_chunks(arrivals_s, durations_s)
    if not chunks:
        return []
    t0, buffered, lateness = chunks[0][0], chunks[0][1], []
    for arrival, duration in chunks[1:]:
        lateness.append(arrival - t0 - buffered)
        buffered += duration
    return lateness


def worst_underrun_s(arrivals_s: list[float], durations_s: list[float]) -> float:
    """max over chunks of lateness, floored at 0."""
    return max([0.0, *chunk_lateness_s(arrivals_s, durations_s)])


def stream_speed_x(arrivals_s: list[float], durations_s: list[float]) -> float | None:
    """Audio seconds per wall second after the first chunk (> 1 keeps up with playback); None if < 2 chunks."""
    chunks = audio_chunks(arrivals_s, durations_s)
    if len(chunks) < 2 or chunks[-1][0] <= chunks[0][0]:
        return None
    return sum(d for _, d in chunks[1:]) / (chunks[-1][0] - chunks[0][0])


def is_viable(record: RequestRecord, tolerance_s: float = 0.0) -> bool:
    """OK status, some audio, and every chunk on time."""
    if not record.is_ok or ttfa_s(record.arrivals_s, record.durations_s) is None:
        return False
    return all(late <= tolerance_s for late in chunk_lateness_s(record.arrivals_s, record.durations_s))


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; inf values sort last."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    if lo == hi or ordered[hi] == ordered[lo]:
        return ordered[lo]
    if math.isinf(ordered[hi]):
        return math.inf
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def request_ttfas_s(records: list[RequestRecord]) -> list[float]:
    """TTFA per request; a failed or silent request counts as infinitely late (it never played)."""
    out = []
    for r in records:
        t = ttfa_s(r.arrivals_s, r.durations_s) if r.is_ok else None
        out.append(math.inf if t is None else t)
    return out


@dataclass
class RateSummary:
    """DESIGN §1 metrics of one rate step."""

    rate_rps: float
    num_requests: int
    num_ok: int
    ttfa_p50_s: float | None
    ttfa_p90_s: float | None
    ttfa_p99_s: float | None
    pct_viable: float
    pct_chunks_on_time: float
    worst_underrun_s: float
    underruns_s: list[float]
    stream_speed_p50_x: float | None  # median audio-per-wall-second after the first chunk
    audio_s: float
    errors: dict[str, int]

    def to_json(self) -> dict:
        """JSON-safe dict (inf -> None)."""
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


def summarize(rate_rps: float, records: list[RequestRecord]) -> RateSummary:
    ttfas = request_ttfas_s(records)
    lateness = [x for r in records if r.is_ok for x in chunk_lateness_s(r.arrivals_s, r.durations_s)]
    underruns = [worst_underrun_s(r.arrivals_s, r.durations_s) for r in records if r.is_ok]
    speeds = [x for r in records if r.is_ok and (x := stream_speed_x(r.arrivals_s, r.durations_s)) is not None]
    errors: dict[str, int] = {}
    for r in records:
        if not r.is_ok:
            errors[r.error or "error"] = errors.get(r.error or "error", 0) + 1
    n = len(records)
    return RateSummary(
        rate_rps=rate_rps, num_requests=n, num_ok=sum(r.is_ok for r in records),
        ttfa_p50_s=percentile(ttfas, 50), ttfa_p90_s=percentile(ttfas, 90), ttfa_p99_s=percentile(ttfas, 99),
        pct_viable=100.0 * sum(is_viable(r) for r in records) / n if n else 0.0,
        pct_chunks_on_time=100.0 * sum(x <= 0 for x in lateness) / len(lateness) if lateness else 100.0,
        worst_underrun_s=max([0.0, *underruns]), underruns_s=underruns, stream_speed_p50_x=percentile(speeds, 50),
        audio_s=sum(sum(r.durations_s) for r in records if r.is_ok), errors=errors,
    )  # fmt: skip


def meets_slo(summary: RateSummary, slo_ttfa_p90_s: float, min_pct_viable: float = 99.0) -> bool:
    p90 = summary.ttfa_p90_s
    return (
        summary.num_requests > 0 and p90 is not None and p90 <= slo_ttfa_p90_s and summary.pct_viable >= min_pct_viable
    )


def capacity_at_slo(summaries: list[RateSummary], slo_ttfa_p90_s: float, min_pct_viable: float = 99.0) -> float:
    """Highest swept rate that meets the SLO with every lower swept rate meeting it too; 0 if none."""
    return highest_rate_meeting(summaries, lambda s: meets_slo(s, slo_ttfa_p90_s, min_pct_viable))


def highest_rate_meeting(rows: Sequence[R], meets: Callable[[R], bool]) -> float:
    """The highest `rate_rps` of `rows` for which `meets` holds, with every lower rate meeting it too; 0 if none."""
    capacity = 0.0
    for row in sorted(rows, key=lambda r: r.rate_rps):
        if not meets(row):
            break
        capacity = row.rate_rps
    return capacity

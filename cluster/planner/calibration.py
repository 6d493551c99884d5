"""Calibration tables for the capacity planner: what one step of each stage costs on one device.

A calibration is a small JSON file (`calibrations/<gpu>-<model>.json`, every number with its source)
read into typed tables: the LLM decode step in ms by rows x tokens cached, the detokenizer's forward in ms
by frames in its batch, the hops between stages, the chunk schedule and the serving limits measured with;
where the stages share the host's cores, its `host` section and optionally `host_range` (the cheapest and
dearest host one calibration measured); optionally `llm.step_spread`, how the serving steps scatter around
the table's mean. `cluster.planner.simulate` prices each simulated step with these;
`voxray plan` picks a file by `--gpu` / `--model`. Bad files or names raise `InvalidArgumentError` naming the
field.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import InvalidArgumentError

CALIBRATION_DIR = Path(__file__).with_name("calibrations")
ROWS_LOOKED_UP = 4097  # a step's batch rows below this are read from a table computed once (`StepTable.step_ms`)


@dataclass(frozen=True)
class StepTable:
    """LLM decode step ms at `rows` (ascending) x `cache_tokens` (ascending): `ms[i][j]`. Outside the rows,
    the last segment's slope carries on; past the last cache column the last two columns' slope does, or with
    one column the KV read a row adds (`kv_bytes_per_token` at `memory_bandwidth_bytes_per_s`)."""

    rows: tuple[int, ...]
    cache_tokens: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]
    kv_bytes_per_token: float = 0.0
    memory_bandwidth_bytes_per_s: float = 1.0

    def step_ms(self, rows: np.ndarray, cache_tokens: np.ndarray) -> np.ndarray:
        """Vectorised: ms of one step for each (rows, mean tokens cached) pair; 0 where rows is 0."""
        rows = np.asarray(rows, dtype=np.float64)
        cache = np.asarray(cache_tokens, dtype=np.float64)
        whole = rows.astype(np.int64)
        if rows.size and np.array_equal(whole, rows) and 0 <= whole.min() and whole.max() < ROWS_LOOKED_UP:
            by_rows = self._columns_by_whole_rows()  # the simulation's every step: read, not interpolated
            columns = [by_rows[j][whole] for j in range(len(self.cache_tokens))]
        else:
            columns = self._columns(rows)
        if len(columns) == 1:
            extra_tokens = np.maximum(cache - self.cache_tokens[0], 0.0)
            kv_ms = rows * extra_tokens * self.kv_bytes_per_token / self.memory_bandwidth_bytes_per_s * 1e3
            ms = columns[0] + kv_ms
        else:
            stacked = np.stack(columns, axis=-1)  # [..., cache columns]
            ms = _interp_columns(cache, self.cache_tokens, stacked)
        return np.where(rows > 0, np.maximum(ms, 0.0), 0.0)

    def _columns(self, rows: np.ndarray) -> list[np.ndarray]:
        """Each cache column's ms interpolated (extrapolated) at `rows`."""
        table = np.asarray(self.ms)  # [rows, cache columns]
        return [_interp_extrapolate(rows, self.rows, table[:, j]) for j in range(len(self.cache_tokens))]

    # frozen and hashable; ~32 KB a table, the 16 latest kept (a process that sweeps many calibrations stays bounded)
    @functools.lru_cache(maxsize=16)  # noqa: B019
    def _columns_by_whole_rows(self) -> list[np.ndarray]:
        """`_columns` at 0, 1, ..., ROWS_LOOKED_UP - 1 rows: the same values, computed once."""
        return self._columns(np.arange(ROWS_LOOKED_UP, dtype=np.float64))


@dataclass(frozen=True)
class DetokTable:
    """Detokenizer forward ms by the window frames in one batch (sum over its chunks), ascending."""

    batch_frames: tuple[int, ...]
    ms: tuple[float, ...]
    max_batch_chunks: int

    def batch_ms(self, frames: np.ndarray | float) -> np.ndarray:
        return np.maximum(_interp_extrapolate(np.asarray(frames, np.float64), self.batch_frames, self.ms), 0.0)


@dataclass(frozen=True)
class ScheduleSpec:
    """The chunk schedule the stages ran with (fields of `core.config.DetokConfig`)."""

    first_chunk_frames: int
    chunk_frames: int
    left_context_frames: int
    right_context_frames: int
    adaptive: bool


@dataclass(frozen=True)
class HostCost:
    """The host's CPUs when the stages share them (`cluster.planner.shared_cores`); `cores` 0: each stage
    replica owns its device (a GPU fleet) and nothing below counts."""

    cores: float = 0.0
    background_cores: float = 0.0  # what the idle server's processes take, less the per-replica part below
    cpu_ms_per_stream: float = 0.0  # a stream's start and end beside the engines (Router, proxy, Ray, client)
    cpu_ms_per_chunk: float = 0.0  # a chunk's trip beside the engines
    # each stage replica's idle share (its own process, the controller's and GCS's upkeep of it): a 2x2
    # idles at more than a 1x1 (0.20 vs 0.14 cores on the 2-core box, 2026-12-06)
    background_cores_per_replica: float = 0.0

    def background_for(self, stage_replicas: int) -> float:
        """The idle server's cores with `stage_replicas` LLM and detok replicas in all."""
        return self.background_cores + self.background_cores_per_replica * stage_replicas


@dataclass(frozen=True)
class HostRange:
    """The spread of the `host` section one calibration measured (`loadtest.host_fit.calibration_host_range`:
    its idle spells and its rounds of closed-loop levels): `low` the cheapest host seen, `high` the dearest.
    A cheaper host leaves the stages more cores: `low` gives the MORE capacity, `high` the less."""

    low: HostCost
    high: HostCost


@dataclass(frozen=True)
class StepSpread:
    """`llm.step_spread`: how the serving steps scatter around the table's mean step. A simulated replica
    draws a factor from `spells` every `spell_s` of its clock and one from `steps` every step; its step costs
    the table's x both. Each is equally likely values of mean 1 (the table stays the mean step)."""

    spell_s: float
    spells: tuple[float, ...]
    steps: tuple[float, ...]


@dataclass(frozen=True)
class Calibration:
    """One device + model: the stage costs the planner prices steps with, and where they came from."""

    gpu: str
    model: str
    family: str
    device: str
    llm_step: StepTable
    prefill_ms_per_token: float
    pipeline_step_factor: float  # the serving loop's step / the engine's alone (host work per step)
    max_streams_per_replica: int
    detok: DetokTable
    llm_to_detok_s: float
    detok_to_client_s: float
    schedule: ScheduleSpec
    sources: dict[str, str]
    host: HostCost = HostCost()
    host_range: HostRange | None = None  # None: no spread measured (older files, GPU fleets)
    llm_step_spread: StepSpread | None = None  # None: every step the table's (older files, GPU fleets)


def _interp_extrapolate(x: np.ndarray, xs: tuple, ys: tuple | np.ndarray) -> np.ndarray:
    """Piecewise-linear through (xs, ys), extended past both ends along the end segments."""
    xs_arr, ys_arr = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    if len(xs_arr) == 1:
        return np.full_like(x, ys_arr[0], dtype=np.float64)
    inside = np.interp(x, xs_arr, ys_arr)
    low_slope = (ys_arr[1] - ys_arr[0]) / (xs_arr[1] - xs_arr[0])
    high_slope = (ys_arr[-1] - ys_arr[-2]) / (xs_arr[-1] - xs_arr[-2])
    below = ys_arr[0] + low_slope * (x - xs_arr[0])
    above = ys_arr[-1] + high_slope * (x - xs_arr[-1])
    return np.where(x < xs_arr[0], below, np.where(x > xs_arr[-1], above, inside))


def _interp_columns(cache: np.ndarray, cache_tokens: tuple[int, ...], stacked: np.ndarray) -> np.ndarray:
    """Per element, interpolate its row of `stacked` [..., C] at its own `cache` value."""
    xs = np.asarray(cache_tokens, np.float64)
    hi = np.clip(np.searchsorted(xs, cache, side="right"), 1, len(xs) - 1)
    lo = hi - 1
    weight = (cache - xs[lo]) / (xs[hi] - xs[lo])  # may leave [0, 1]: extrapolation along the end columns
    weight = np.maximum(weight, 0.0)  # never cheaper than the shortest cache measured
    y_lo = np.take_along_axis(stacked, lo[..., None], axis=-1)[..., 0]
    y_hi = np.take_along_axis(stacked, hi[..., None], axis=-1)[..., 0]
    return y_lo + weight * (y_hi - y_lo)


def available() -> list[tuple[str, str]]:
    """(gpu, model) of every bundled calibration."""
    pairs = []
    for path in sorted(CALIBRATION_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        pairs.append((str(data.get("gpu")), str(data.get("model"))))
    return pairs


def find_calibration(gpu: str, model: str) -> Calibration:
    """The bundled calibration for `gpu` and `model`; an unknown name raises naming `gpu` or `model`."""
    pairs = available()
    if not pairs:
        raise InvalidArgumentError("calibration", f"no calibration files in {CALIBRATION_DIR} (not installed?)")
    models = sorted({m for _, m in pairs})
    if model not in models:
        raise InvalidArgumentError("model", f"no calibration for model {model!r}; calibrated: {', '.join(models)}")
    gpus = sorted(g for g, m in pairs if m == model)
    if gpu not in gpus:
        raise InvalidArgumentError("gpu", f"no calibration for gpu {gpu!r} with {model}; calibrated: {', '.join(gpus)}")
    return load_calibration(CALIBRATION_DIR / f"{gpu}-{model}.json")


def load_calibration(path: Path) -> Calibration:
    """Parse and check one calibration file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise InvalidArgumentError("calibration", f"cannot read {path}: {err}") from err
    return parse_calibration(data)


def parse_calibration(data: dict[str, Any]) -> Calibration:
    llm, detok, transfer = _section(data, "llm"), _section(data, "detok"), _section(data, "transfer")
    return Calibration(
        gpu=_text(data, "gpu"), model=_text(data, "model"), family=_text(data, "family"),
        device=_text(data, "device"),
        llm_step=_step_table(_section(llm, "step_ms", "llm."), llm),
        prefill_ms_per_token=_number(llm, "prefill_ms_per_token", "llm.", allow_zero=True),
        pipeline_step_factor=_number(llm, "pipeline_step_factor", "llm."),
        max_streams_per_replica=int(_number(llm, "max_streams_per_replica", "llm.")),
        detok=_detok_table(detok),
        llm_to_detok_s=_number(transfer, "llm_to_detok_s", "transfer.", allow_zero=True),
        detok_to_client_s=_number(transfer, "detok_to_client_s", "transfer.", allow_zero=True),
        schedule=_schedule(_section(data, "schedule")),
        sources={str(k): str(v) for k, v in _section(data, "sources").items()},
        host=_host(data.get("host")),
        host_range=_host_range(data.get("host_range"), has_host="host" in data),
        llm_step_spread=_step_spread(llm.get("step_spread")),
    )  # fmt: skip


SPREAD_MEAN_TOLERANCE = 0.02  # a spread's factors may average this far from 1 (rounding) and are scaled to 1


def _step_spread(spread: Any) -> StepSpread | None:
    """The optional `llm.step_spread` (absent: None): `spell_s` > 0, `spells` and `steps` each at least 2
    positive factors averaging 1 (within SPREAD_MEAN_TOLERANCE, then scaled to exactly 1)."""
    if spread is None:
        return None
    if not isinstance(spread, dict):
        raise InvalidArgumentError("llm.step_spread", "not an object")
    spell_s = _number(spread, "spell_s", "llm.step_spread.")
    return StepSpread(spell_s, _factors(spread, "spells"), _factors(spread, "steps"))


def _factors(spread: dict[str, Any], key: str) -> tuple[float, ...]:
    field, values = f"llm.step_spread.{key}", spread.get(key)
    if (not isinstance(values, list) or len(values) < 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)):
        raise InvalidArgumentError(field, "must be a list of at least 2 positive numbers")  # fmt: skip
    mean = float(np.mean(values))
    if abs(mean - 1.0) > SPREAD_MEAN_TOLERANCE:
        raise InvalidArgumentError(field, f"must average 1 (factors of the mean step), got {mean:.4f}")
    return tuple(float(v) / mean for v in values)


def _host(host: Any, field: str = "host") -> HostCost:
    """The optional `host` section (absent: stages own their devices); `field` names it in errors."""
    if host is None:
        return HostCost()
    if not isinstance(host, dict):
        raise InvalidArgumentError(field, "not an object")
    names = ("cores", "background_cores", "cpu_ms_per_stream", "cpu_ms_per_chunk")
    values = {name: _number(host, name, f"{field}.", allow_zero=True) for name in names}
    if "background_cores_per_replica" in host:  # optional: older calibrations priced one idle server
        values["background_cores_per_replica"] = _number(host, "background_cores_per_replica", f"{field}.",
                                                         allow_zero=True)  # fmt: skip
    return HostCost(**values)


def _host_range(host_range: Any, has_host: bool) -> HostRange | None:
    """The optional `host_range` section: `low` and `high`, each a complete `host` section (absent: None)."""
    if host_range is None:
        return None
    if not has_host:
        raise InvalidArgumentError("host_range", "given without a `host` section to range around")
    if not isinstance(host_range, dict):
        raise InvalidArgumentError("host_range", "not an object")
    ends = {}
    for end in ("low", "high"):
        if not isinstance(host_range.get(end), dict):
            raise InvalidArgumentError(f"host_range.{end}", "missing or not an object")
        ends[end] = _host(host_range[end], f"host_range.{end}")
    return HostRange(**ends)


def _step_table(step: dict[str, Any], llm: dict[str, Any]) -> StepTable:
    rows = _ascending(step, "rows", "llm.step_ms.")
    cache = _ascending(step, "cache_tokens", "llm.step_ms.")
    ms = step.get("ms")
    if not isinstance(ms, list) or len(ms) != len(rows) or any(len(r) != len(cache) for r in ms):
        raise InvalidArgumentError("llm.step_ms.ms", f"must be a {len(rows)} x {len(cache)} list of lists")
    return StepTable(
        rows=tuple(int(r) for r in rows), cache_tokens=tuple(int(c) for c in cache),
        ms=tuple(tuple(float(v) for v in row) for row in ms),
        kv_bytes_per_token=_number(llm, "kv_bytes_per_token", "llm.", allow_zero=True),
        memory_bandwidth_bytes_per_s=_number(llm, "memory_bandwidth_bytes_per_s", "llm."),
    )  # fmt: skip


def _detok_table(detok: dict[str, Any]) -> DetokTable:
    frames = _ascending(detok, "batch_frames", "detok.")
    ms = detok.get("ms")
    if not isinstance(ms, list) or len(ms) != len(frames):
        raise InvalidArgumentError("detok.ms", f"must list {len(frames)} numbers, one per batch_frames")
    max_chunks = int(_number(detok, "max_batch_chunks", "detok."))
    return DetokTable(tuple(int(f) for f in frames), tuple(float(v) for v in ms), max_chunks)


def _schedule(schedule: dict[str, Any]) -> ScheduleSpec:
    sizes = {
        name: int(_number(schedule, name, "schedule.", allow_zero=name.endswith("context_frames")))
        for name in ("first_chunk_frames", "chunk_frames", "left_context_frames", "right_context_frames")
    }
    return ScheduleSpec(**sizes, adaptive=bool(schedule.get("adaptive", False)))


def _section(data: dict[str, Any], key: str, prefix: str = "") -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise InvalidArgumentError(prefix + key, "missing or not an object")
    return value


def _text(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(key, "missing or not a string")
    return value


def _number(data: dict[str, Any], key: str, prefix: str, allow_zero: bool = False) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(prefix + key, "missing or not a number")
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidArgumentError(prefix + key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)


def _ascending(data: dict[str, Any], key: str, prefix: str) -> list[float]:
    values = data.get(key)
    if not isinstance(values, list) or not values or not all(isinstance(v, (int, float)) for v in values):
        raise InvalidArgumentError(prefix + key, "must be a non-empty list of numbers")
    if any(b <= a for a, b in zip(values, values[1:], strict=False)) or values[0] <= 0:
        raise InvalidArgumentError(prefix + key, "must be positive and strictly ascending")
    return values

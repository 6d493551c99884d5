"""Stage processes sharing a host's CPU cores: how fast each runs while the others and the host's own work
(the Router, Serve's proxy, Ray's daemons, the clients) want the same cores.

On a GPU fleet each stage replica owns its device and this model is off (`HostCost.cores` 0). On a CPU box
(the CPU preset, the planner-vs-cluster check) every LLM and detok replica steps on the same few cores: a
replica with work is one runnable thread, the host's work takes CPU seconds per stream started and per chunk
cut, and the box's idle background a share fixed for the cluster's size (`HostCost.background_for`).
Processor sharing: the host's work and the background come off the top, and the runnable stage processes
split what is left, none faster than one core. Each stage's step or batch lasts its calibrated cost / that
speed.

The timeline is a grid of `BIN_S` bins. A pass through one stage reads the other stage's busy time from the
pass before (`cluster.planner.predict.run_llm` runs the stages more than once) and the host's work from the
starts and chunks the last LLM pass made, so the two stages' contention is settled over passes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from cluster.planner.calibration import HostCost

BIN_S = 0.01
HOST_SPREAD_S = 0.2  # a start's or a chunk's host work is spread over this long (Ray calls, gRPC messages)
MIN_SPEED = 0.05  # never slower than this share of a core, however loaded (keeps the clocks moving)


@dataclass
class CoreShare:
    """Busy time of each stage on the grid (in processes busy, fractional), and the host's work (in cores)."""

    host: HostCost
    llm_busy: np.ndarray
    detok_busy: np.ndarray
    host_cores: np.ndarray
    stage_replicas: int = 2  # LLM and detok replicas in all: the idle background grows with them

    @classmethod
    def empty(cls, host: HostCost, horizon_s: float, stage_replicas: int = 2) -> CoreShare:
        bins = int(horizon_s / BIN_S) + 2
        return cls(host, np.zeros(bins), np.zeros(bins), np.zeros(bins), stage_replicas)

    @property
    def enabled(self) -> bool:
        return self.host.cores > 0

    def bins(self, t_s: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(t_s) / BIN_S).astype(np.int64), 0, len(self.llm_busy) - 1)

    def speed(self, t_s: np.ndarray, own: str) -> np.ndarray:
        """The share of a core a process of stage `own` ("llm" or "detok") gets at `t_s`: the cores left
        after the background and the host's work, split among the busy stage processes (`own` counted as at
        least one: it is about to run)."""
        t_s = np.asarray(t_s, np.float64)
        if not self.enabled:
            return np.ones_like(t_s)
        b = self.bins(t_s)
        llm, detok = self.llm_busy[b], self.detok_busy[b]
        if own == "llm":
            llm = np.maximum(llm, 1.0)
        else:
            detok = np.maximum(detok, 1.0)
        left = self.host.cores - self.host.background_for(self.stage_replicas) - self.host_cores[b]
        return np.clip(left / (llm + detok), MIN_SPEED, 1.0)

    def with_host_work(self, starts_s: np.ndarray, chunks_s: np.ndarray) -> CoreShare:
        """A copy whose host work is `host.cpu_ms_per_stream` at each start and `cpu_ms_per_chunk` at each
        chunk cut, spread over HOST_SPREAD_S."""
        cpu_s = np.zeros(len(self.host_cores))
        starts_s = np.asarray(starts_s)[np.isfinite(starts_s)]
        np.add.at(cpu_s, self.bins(starts_s), self.host.cpu_ms_per_stream / 1e3)
        np.add.at(cpu_s, self.bins(chunks_s), self.host.cpu_ms_per_chunk / 1e3)
        width = max(1, int(round(HOST_SPREAD_S / BIN_S)))
        spread = np.convolve(cpu_s, np.ones(width) / width, mode="full")[: len(cpu_s)]
        return replace(self, host_cores=spread / BIN_S)

    def busy_series(self, starts_s: np.ndarray, durations_s: np.ndarray) -> np.ndarray:
        """Processes busy per bin (fractional) for work running from `starts_s` for `durations_s`."""
        busy = np.zeros(len(self.llm_busy))
        if not self.enabled or len(starts_s) == 0:
            return busy
        first, last = self.bins(starts_s), self.bins(np.asarray(starts_s) + np.asarray(durations_s))
        one_bin = first == last
        np.add.at(busy, first[one_bin], np.asarray(durations_s)[one_bin] / BIN_S)
        for lo, hi, start, duration in zip(first[~one_bin], last[~one_bin], np.asarray(starts_s)[~one_bin],
                                           np.asarray(durations_s)[~one_bin], strict=True):  # fmt: skip
            busy[lo + 1 : hi] += 1.0
            busy[lo] += (lo + 1) - start / BIN_S
            busy[hi] += (start + duration) / BIN_S - hi
        return busy

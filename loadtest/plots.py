"""PNG plots of one or more sweep results (matplotlib, Agg backend; no display needed).

p90 TTFA vs rate, % viable vs rate, and the distribution (CDF) of per-request worst underrun.
Called by `loadtest.sweep` and `loadtest.run_all` with SweepResult dicts (as in the JSON).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(result: dict, key: str) -> tuple[list[float], list[float | None]]:
    summaries = [step["summary"] for step in result["steps"]]
    return [s["rate_rps"] for s in summaries], [s[key] for s in summaries]


def plot_ttfa(results: list[dict], path: Path, slo_s: float) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for result in results:
        rates, p90 = _series(result, "ttfa_p90_s")
        ceiling = 10 * slo_s  # failed requests make p90 infinite; draw them at the top of the plot
        ax.plot(rates, [ceiling if v is None else min(v, ceiling) for v in p90], marker="o", label=result["label"])
    ax.axhline(slo_s, color="grey", linestyle="--", label=f"SLO {slo_s:g} s")
    ax.set(xlabel="request rate (req/s)", ylabel="p90 TTFA (s)", yscale="log", title="p90 TTFA vs rate")
    _finish(fig, ax, path)


def plot_viable(results: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for result in results:
        rates, viable = _series(result, "pct_viable")
        ax.plot(rates, viable, marker="o", label=result["label"])
    ax.axhline(99, color="grey", linestyle="--", label="99%")
    ax.set(xlabel="request rate (req/s)", ylabel="% requests viable", ylim=(-2, 102), title="Streaming viability")
    _finish(fig, ax, path)


def plot_underrun(results: list[dict], path: Path) -> None:
    """One panel per result: CDF of per-request worst underrun, one line per rate."""
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.8), squeeze=False, sharey=True)
    for ax, result in zip(axes[0], results, strict=True):
        for step in result["steps"]:
            values = sorted(step["summary"]["underruns_s"])
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                        label=f"{step['summary']['rate_rps']:g} req/s")  # fmt: skip
        ax.set(xlabel="worst underrun per request (s)", title=result["label"])
        ax.set_xscale("symlog", linthresh=0.05)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("fraction of completed requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finish(fig, ax, path: Path) -> None:
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(results: list[dict], out_dir: Path, slo_s: float) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "ttfa_p90_vs_rate.png", out_dir / "viable_vs_rate.png", out_dir / "underrun_cdf.png"]
    plot_ttfa(results, paths[0], slo_s)
    plot_viable(results, paths[1])
    plot_underrun(results, paths[2])
    return paths


def plot_soak(samples: list[dict], path: Path, warm_up_s: float, load_end_s: float) -> Path:
    """`loadtest.soak`'s time series: RSS per process (log scale) and in all, open fds per process, the
    object store, the stream gauges; dashed lines at the warm-up and at the end of the load."""
    panels = [("rss_mb/", "RSS (MB)"), ("rss_mb/total", "RSS, all (MB)"), ("fds/", "open fds"),
              ("object_store_mb", "object store (MB)"), ("object_store_objects", "object store (objects)"),
              ("gauge/", "VoxRay gauges")]  # fmt: skip
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels)), sharex=True)
    times_min = [s["t_s"] / 60 for s in samples]
    for ax, (prefix, ylabel) in zip(axes, panels, strict=True):
        names = sorted({name for s in samples for name in s["values"] if name.startswith(prefix)})
        if prefix == "rss_mb/":  # the processes on a log scale; their sum has its own panel
            names = [name for name in names if name != "rss_mb/total"]
            ax.set_yscale("log")
        for name in names:
            values = [s["values"].get(name, float("nan")) for s in samples]
            ax.plot(times_min, values, label=name.removeprefix(prefix) or name, linewidth=1)
        for at_s in (warm_up_s, load_end_s):
            ax.axvline(at_s / 60, color="grey", linestyle="--", linewidth=0.8)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[-1].set_xlabel("minutes since the start (dashed: warm-up, end of load)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

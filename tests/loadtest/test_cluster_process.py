"""loadtest/cluster_process.py's start: a server process that ends before it serves fails at once with its
log's end, and one whose Ray timed out in its own start (a loaded box) is started once more."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.config import ServeConfig
from loadtest import cluster_process, run_all
from loadtest.cluster_process import ServerProcess, start_server, wait_serving
from loadtest.server_start import RAY_START_TIMED_OUT, ServerExited


def exited_server(tmp_path, log_text: str, name: str = "serve") -> ServerProcess:
    log = tmp_path / f"{name}.log"
    log.write_text(log_text)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    return ServerProcess(proc, ServeConfig(), log)


def test_a_server_that_ends_before_it_serves_fails_at_once_with_its_log(tmp_path):
    server = exited_server(tmp_path, "starting\nValueError: engine.cache.num_slots must be > 0\n")
    with pytest.raises(ServerExited, match="num_slots must be > 0"):
        wait_serving(server, timeout_s=60.0)  # not the 60 s: the process is already gone


@pytest.mark.parametrize("error, launches", [(f"Exception: The current node {RAY_START_TIMED_OUT}.", 2),
                                             ("ValueError: a bad config", 1)])  # fmt: skip
def test_only_a_ray_start_that_timed_out_is_started_again(tmp_path, monkeypatch, error, launches):
    launched = []

    def launch(config, scratch):
        launched.append(config)
        return exited_server(tmp_path, f"Traceback ...\n{error}\n", name=f"serve-{len(launched)}")

    monkeypatch.setattr(cluster_process, "launch_server", launch)
    with pytest.raises(ServerExited):
        start_server(ServeConfig(), tmp_path / "scratch", ready_timeout_s=30.0)
    assert len(launched) == launches


@pytest.mark.parametrize("error, launches", [(f"Exception: The current node {RAY_START_TIMED_OUT}.", 2),
                                             ("ValueError: a bad config", 1)])  # fmt: skip
def test_a_sweep_system_that_exits_before_it_serves_fails_at_once_and_only_a_ray_timeout_starts_again(
        tmp_path, error, launches):  # fmt: skip
    """`run_all.start_ready` (the sweep smoke's and `make sweep`'s start): each launch appends a line to a
    file and exits with `error` in its log, so the count of lines is the count of launches."""
    launched = tmp_path / "launched"
    script = f"open({str(launched)!r}, 'a').write('x\\n'); print({error!r}, flush=True); raise SystemExit(1)"
    system = run_all.System("exits", 1, [sys.executable, "-c", script], ready_timeout_s=120.0)
    with pytest.raises(ServerExited, match=error.split(":")[0]):
        run_all.start_ready(system, tmp_path, "voxray")
    assert launched.read_text().count("x") == launches

"""SIGTERM to a real `voxray serve` (own local Ray, own ports) with streams playing: new streams
are refused with UNAVAILABLE and a retry hint at once, short streams finish, long ones end at
the drain deadline with UNAVAILABLE and a retry hint, and the process exits 0 with no native
stack dump in its output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from core.config import DrainConfig, ServeConfig
from loadtest.sweep import wait_ready
from tests.deployments.grpc_helpers import run_stream

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
_OFFSET = int(os.environ.get("VOXRAY_TEST_PORT_OFFSET", "0"))  # see tests/deployments/conftest.py
GRPC_PORT, HTTP_PORT = 19230 + _OFFSET, 19231 + _OFFSET
CRASH_MARKS = ("Fatal Python error", "SIGABRT", "*** SIG", "Aborted", "Stack trace", "core dumped")


def _start_server(tmp_path: Path, grace_s: float) -> tuple[subprocess.Popen, Path]:
    config = ServeConfig(grpc_port=GRPC_PORT, http_port=HTTP_PORT, drain=DrainConfig(grace_s=grace_s))
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(path)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)  # fmt: skip
    return proc, log


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _first_refused(target: str, within_s: float):
    """A new stream sent until one is refused (the Routers see the drain at their next poll: ~0.5 s
    on a quiet box, longer on a loaded one; a stream admitted before that plays, as it should)."""
    give_up_s = time.monotonic() + within_s
    while True:
        outcome = run_stream(target, "voxray", "too late", sampling={"max_tokens": 14})
        if outcome.code != grpc.StatusCode.OK or time.monotonic() > give_up_s:
            return outcome
        time.sleep(0.1)


def test_sigterm_drains_streams_and_exits_cleanly(tmp_path):
    proc, log = _start_server(tmp_path, grace_s=3.0)
    try:
        target = f"127.0.0.1:{GRPC_PORT}"
        wait_ready(target, "voxray", 240.0)
        outcomes: dict[str, object] = {}
        jobs = {"short-0": 7 * 6, "short-1": 7 * 6, "long-0": 2000, "long-1": 2000}

        def play(name: str, max_tokens: int) -> None:
            sampling = {"max_tokens": max_tokens, "seed": 1}
            outcomes[name] = run_stream(target, "voxray", f"drain {name}", sampling=sampling, request_id=name)

        threads = [threading.Thread(target=play, args=item) for item in jobs.items()]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # all four are playing
        proc.send_signal(signal.SIGTERM)
        refused = _first_refused(target, within_s=10.0)
        for thread in threads:
            thread.join(timeout=60)
        exit_code = proc.wait(timeout=60)
        output = log.read_text()
        assert exit_code == 0, output[-3000:]
        assert not [mark for mark in CRASH_MARKS if mark in output], output[-3000:]
        assert refused.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details
        assert int(refused.trailers["retry-after-ms"]) > 0
        for name in ("short-0", "short-1"):
            assert outcomes[name].code == grpc.StatusCode.OK and outcomes[name].chunks[-1].final, name
        for name in ("long-0", "long-1"):
            outcome = outcomes[name]
            assert outcome.code == grpc.StatusCode.UNAVAILABLE, (name, outcome.code, outcome.details)
            assert outcome.chunks and int(outcome.trailers["retry-after-ms"]) > 0
        print(output[output.index("stopping:") :].strip())
    finally:
        _kill_group(proc)

"""`make test`: the suite as two pytest processes side by side, one per CI core. The tests that serve a
cluster (marker `cluster`, tests/conftest.py) run in one, one after another in file order as a plain
`pytest` runs them (one Ray at a time, their waits mostly idle); the unit tests (CPU-bound) in the other.
Each run's output is printed whole as soon as it ends, and a line says every minute which are still
running (a CI that stops a silent job sees progress); the exit status is non-zero when either run
failed. Arguments go to both runs (`python -m tests.split_run -x`)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from typing import IO

RUNS = {"unit tests": ["-m", "not cluster"], "cluster tests": ["-m", "cluster"]}
NO_TESTS_COLLECTED = 5  # pytest's exit status when a run selected nothing (arguments naming one side only)
STATUS_EVERY_S = 60.0
POLL_S = 1.0


def start(selection: list[str], argv: list[str]) -> tuple[subprocess.Popen, IO[bytes]]:
    log = tempfile.TemporaryFile()
    command = [sys.executable, "-m", "pytest", "-q", *selection, *argv]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log


def show(name: str, code: int, log: IO[bytes]) -> None:
    log.seek(0)
    print(f"===== {name} (pytest exit status {code}) =====", flush=True)
    sys.stdout.buffer.write(log.read())
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    started_s = time.monotonic()
    running = {name: start(selection, argv) for name, selection in RUNS.items()}
    codes: dict[str, int] = {}
    next_status_s = started_s + STATUS_EVERY_S
    while running:
        time.sleep(POLL_S)
        for name, (process, log) in list(running.items()):
            if process.poll() is not None:
                codes[name] = process.returncode
                show(name, process.returncode, log)
                del running[name]
        if running and time.monotonic() >= next_status_s:
            print(f"----- {time.monotonic() - started_s:.0f} s: {', '.join(running)} still running", flush=True)
            next_status_s += STATUS_EVERY_S
    failed = [name for name, code in codes.items() if code not in (0, NO_TESTS_COLLECTED)]
    ran = any(code == 0 for code in codes.values())
    print(f"===== {time.monotonic() - started_s:.0f} s in all; failed: {', '.join(failed) or 'none'} =====")
    return 1 if failed or not ran else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`make test`: the suite as two pytest processes side by side, one per CI core. The tests that serve a
cluster (marker `cluster`, tests/conftest.py) run in one, one after another in file order as a plain
`pytest` runs them (one Ray at a time, their waits mostly idle); the unit tests (CPU-bound) in the other.
Each run's output is printed whole once both have ended, the unit tests' first; the exit status is
non-zero when either run failed. Arguments go to both runs (`python -m tests.split_run -x`)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

RUNS = {"unit tests": ["-m", "not cluster"], "cluster tests": ["-m", "cluster"]}
NO_TESTS_COLLECTED = 5  # pytest's exit status when a run selected nothing (arguments naming one side only)


def main(argv: list[str]) -> int:
    started_s = time.monotonic()
    runs = {}
    for name, selection in RUNS.items():
        log = tempfile.TemporaryFile()
        command = [sys.executable, "-m", "pytest", "-q", *selection, *argv]
        runs[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log)
    codes = {name: process.wait() for name, (process, _) in runs.items()}
    for name, (_, log) in runs.items():
        log.seek(0)
        print(f"===== {name} (pytest exit status {codes[name]}) =====", flush=True)
        sys.stdout.buffer.write(log.read())
        sys.stdout.flush()
    failed = [name for name, code in codes.items() if code not in (0, NO_TESTS_COLLECTED)]
    ran = any(code == 0 for code in codes.values())
    print(f"===== {time.monotonic() - started_s:.0f} s in all; failed: {', '.join(failed) or 'none'} =====")
    return 1 if failed or not ran else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

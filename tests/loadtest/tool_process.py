"""Run a loadtest tool (`python -m loadtest.X ...`) in a process of its own: the bench joins its
server's Ray as a driver, which the test process cannot be while it drives another test's Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_tool(module: str, *args: str, timeout_s: float) -> str:
    """The tool's stdout (printed here too, for the test's report); fails the test on a non-zero exit."""
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)  # fmt: skip
    print(done.stdout)
    assert done.returncode == 0, f"{module} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout

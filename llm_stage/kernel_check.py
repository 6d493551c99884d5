"""Once per process, before a fused Triton kernel serves on a GPU: does it compile and match the
torch ops it replaces there? If not, the caller keeps the torch ops, and the log says why."""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def passes_on_gpu(kernel: str, parity: Callable[[], dict]) -> bool:
    """`parity()`'s "ok", False (with a warning) when it raises or reports a difference."""
    try:
        report = parity()
    except Exception as err:  # a compile or launch failure: the torch ops still serve
        logger.warning("fused %s failed on the GPU (%s): using the torch ops", kernel, err)
        return False
    if not report["ok"]:
        logger.warning("fused %s differs from the torch ops (%s): using the torch ops", kernel, report)
    return bool(report["ok"])

"""Accelerator faults of an engine step: which error is which, and which requests an out-of-memory
step sheds.

An out-of-memory error is the step's own: it asked for more memory than was free. The engine fails
the requests that made that step bigger than the last one that ran (`requests_to_shed`), names them
in `StepOutOfMemory` and keeps serving. Any other device error (a CUDA error, a device-side assert)
leaves the CUDA context unusable for the life of the process (`is_device_lost`): the stage
deployments then end their replica so Serve replaces it (`deployments.engine_loop`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from llm_stage.request import Request
from llm_stage.scheduler import StepPlan

# What a CUDA error says when torch raises it as a plain RuntimeError (kernels, cuBLAS, Triton
# launches, older torch); torch >= 2.8 raises `torch.AcceleratorError` for most of them.
DEVICE_ERROR_MARKERS = ("CUDA error", "device-side assert", "CUBLAS_STATUS_", "CUDNN_STATUS_", "Triton Error [CUDA]")
# ... and those of them that are an allocation refused (not sticky: the context stays usable)
OUT_OF_MEMORY_MARKERS = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


class StepOutOfMemory(Exception):
    """An engine step ran out of accelerator memory. The engine has dropped `req_ids` (KV slots
    freed, no state left) and rolled the step back for every other request, which runs on."""

    def __init__(self, req_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"out of accelerator memory; failed {req_ids}: {cause}")
        self.req_ids = req_ids


def is_out_of_memory(err: BaseException) -> bool:
    """A torch out-of-memory error (also as the cause a Ray error carries), an allocation a CUDA
    library call was refused, or a step's report of one."""
    if isinstance(err, torch.OutOfMemoryError | StepOutOfMemory):
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in OUT_OF_MEMORY_MARKERS)


def is_device_lost(err: BaseException) -> bool:
    """A device error after which this process's CUDA context cannot be trusted (not an OOM)."""
    if is_out_of_memory(err):
        return False
    if isinstance(err, getattr(torch, "AcceleratorError", ())):  # (torch >= 2.8)
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in DEVICE_ERROR_MARKERS)


def release_cached_memory() -> None:
    """After an out-of-memory error: hand the caching allocator's free blocks back to CUDA, so the
    next step's allocations are not refused for fragmentation (a no-op without CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def requests_to_shed(plan: StepPlan, requests: Iterable[Request]) -> list[Request]:
    """The requests an out-of-memory `plan` fails (of `requests`, the engine's guided ones).

    Prompt work in the step: the requests it prefills. Their rows (a prompt chunk, or folded prompt
    tokens on CUDA) are what this step added to a decode batch that ran before, and a request that
    has not played yet loses least by a retry hint; the decodes run on. A decode-only step: the
    newest request in it, one per failed step (each retry sheds one more while the memory is short),
    so the streams playing longest keep playing.
    """
    prefilling = {id(work.req) for work in plan.prefills}
    decoding = {id(row) for row in plan.decodes}
    in_step = [(req, {id(row) for row in req.unit}) for req in requests]
    starting = [req for req, rows in in_step if rows & prefilling]
    if starting:
        return starting
    decoders = [req for req, rows in in_step if rows & decoding]
    return [max(decoders, key=lambda req: req.arrival_s)] if decoders else []

"""Host values onto a device without making the host wait for it.

A plain `tensor.to("cuda")` of pageable memory waits for the stream to drain (a
`cudaStreamSynchronize` per call: five per decode step before this). Staging through pinned
memory and copying with `non_blocking=True` queues the copy behind the work already on the
stream and returns at once; torch's pinned allocator keeps the staging buffer until the copy ran.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`; on CUDA a non-blocking copy from pinned memory."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)

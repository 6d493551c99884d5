"""What a CUDA graph cannot capture, checked on CPU tensors: ops that make the host wait for the
device. A value read into Python (`.item()`, `int(t)`, `bool(t)`: `_local_scalar_dense`) syncs the
stream and fails a capture; so does an op whose output shape depends on tensor values (nonzero,
masked_select, unique, indexing by a boolean mask, repeat_interleave by a tensor of repeats without
`output_size`), which reads that size back. One check for the LLM stage's inner-loop and
decode-attention tests and the detokenizer's graph tests (tests/detok_stage/test_codec_graphs.py)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_WAITING_OPS = frozenset(
    {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
     "unique_consecutive", "repeat_interleave"}
)  # fmt: skip
MASK_INDEXING_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


def waits_for_host(func, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether the aten op `func`, called with `args` / `kwargs`, waits for the device.
    repeat_interleave by an int (`self_int`, e.g. an upsampling stride) or with `output_size` given
    knows its output length without reading the repeats: it does not."""
    name = func.overloadpacket.__name__
    if name == "repeat_interleave":
        return func._overloadname != "self_int" and (kwargs or {}).get("output_size") is None
    if name in MASK_INDEXING_OPS:  # x[mask] / x[mask] = v: the mask's true positions, found by nonzero
        return any(getattr(index, "dtype", None) in (torch.bool, torch.uint8) for index in args[1])
    return name in HOST_WAITING_OPS


class OpNames(TorchDispatchMode):
    """The aten ops run inside the mode (`names`), and those that wait for the host (`host_waiting`)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.host_waiting: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        if waits_for_host(func, args, kwargs):
            self.host_waiting.add(str(func))
        return func(*args, **(kwargs or {}))

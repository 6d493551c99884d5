"""A residual add and the RMSNorm after it, in one kernel: `residual + delta`, then the norm of
that sum as `LlamaBackbone` computes it (normalise in fp32, round to the input dtype, scale by the
weight), both written out.

In bf16 these are ~5 kernels per norm (the add, a cast to fp32, the fused norm, a cast back, the
weight product), 56 norms a step at Orpheus 3B's 28 layers: ~220 of the decode graph's nodes,
each a tiny kernel (on an H200, 2026-12-04, the step's small kernels took ~1.6 ms of its 4.5 ms of
GPU time and a graph launch ~1.7 ms of host time, both growing with the node count). One program
per token row does all of it. The add and the casts round as the torch ops do (`rounding`); the
mean of squares is summed in another order than torch's kernel, so a normalised value can land
one bf16 step away from the torch path's (the tests bound it). Why our own kernel: vLLM's
`fused_add_rms_norm` and FlashInfer's do this, but neither package can be brought to the GPU
lent for our measurements (torch 2.11, no network). Used by `LlamaBackbone` on CUDA when Triton
is there, after a once-per-process check on the GPU; elsewhere the torch ops run.
"""

from __future__ import annotations

import functools

import torch

from llm_stage.attention import next_pow2, triton_available
from llm_stage.kernel_check import passes_on_gpu
from llm_stage.rounding import ROUND_CODES, rounded

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rms_norm(
        residual_ptr, delta_ptr, weight_ptr, sum_ptr, normed_ptr,
        stride_residual, stride_delta, stride_sum, stride_normed,
        hidden, eps,
        BLOCK: tl.constexpr, ROUND: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        columns = tl.arange(0, BLOCK)
        inside = columns < hidden
        residual = tl.load(residual_ptr + row * stride_residual + columns, mask=inside, other=0.0)
        delta = tl.load(delta_ptr + row * stride_delta + columns, mask=inside, other=0.0)
        dtype = residual.dtype
        total = rounded(residual.to(tl.float32) + delta.to(tl.float32), ROUND)
        tl.store(sum_ptr + row * stride_sum + columns, total.to(dtype), mask=inside)
        mean_square = tl.sum(total * total, axis=0) / hidden
        normalised = rounded(total * (1.0 / tl.sqrt(mean_square + eps)), ROUND)  # x * rsqrt(mean(x^2) + eps)
        weight = tl.load(weight_ptr + columns, mask=inside, other=0.0).to(tl.float32)
        tl.store(normed_ptr + row * stride_normed + columns, rounded(weight * normalised, ROUND).to(dtype), mask=inside)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, rms_norm(residual + delta) * weight) for [..., H] tensors (last dim contiguous)."""
    hidden = residual.shape[-1]
    rows_in, deltas = residual.reshape(-1, hidden), delta.reshape(-1, hidden)
    total, normed = torch.empty_like(rows_in), torch.empty_like(rows_in)
    _add_rms_norm[(rows_in.shape[0],)](
        rows_in, deltas, weight, total, normed,
        rows_in.stride(0), deltas.stride(0), total.stride(0), normed.stride(0),
        hidden, eps,
        BLOCK=next_pow2(hidden, 16), ROUND=ROUND_CODES.get(residual.dtype, 0),
    )  # fmt: skip
    return total.view(residual.shape), normed.view(residual.shape)


def reference_add_rms_norm(residual, delta, weight, eps):
    """The torch ops the kernel replaces (`LlamaBackbone`'s unfused path)."""
    total = residual + delta
    if total.dtype == torch.float32:
        return total, torch.nn.functional.rms_norm(total, (total.shape[-1],), weight, eps)
    return total, weight * torch.nn.functional.rms_norm(total.float(), (total.shape[-1],), None, eps).to(total.dtype)


@functools.cache
def fused_add_norm_works(device_index: int) -> bool:
    """Whether the kernel compiles and stays within one bf16 step of the torch ops on this GPU
    (checked once per process); otherwise the backbone keeps the torch ops, and says so."""
    device = torch.device("cuda", device_index)
    return passes_on_gpu("add + RMSNorm", lambda: add_norm_parity(device, rows=8, hidden=256))


def add_norm_parity(device: str | torch.device = "cuda", rows: int = 300, hidden: int = 3072, seed: int = 0) -> dict:
    """The kernel against the torch ops in bf16 and fp32: sums exact, normalised values within one
    bf16 step (2^-7 relative) / fp32 rounding; {"ok": bool, per dtype the largest differences}."""
    device = torch.device(device)
    if device.type != "cuda" or not triton_available():
        return {"ok": True, "skipped": "the Triton kernel runs on CUDA only"}
    gen = torch.Generator().manual_seed(seed)
    out: dict = {}
    ok = True
    for dtype, tolerance in ((torch.bfloat16, 2.0**-7), (torch.float32, 1e-5)):
        residual = (torch.randn(rows, hidden, generator=gen) * 3).to(device, dtype)
        delta = torch.randn(rows, hidden, generator=gen).to(device, dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
        total, normed = add_rms_norm(residual, delta, weight, 1e-5)
        want_total, want_normed = reference_add_rms_norm(residual, delta, weight, 1e-5)
        relative = ((normed.float() - want_normed.float()).abs() / want_normed.float().abs().clamp(min=1e-3)).max()
        case = {"sums_equal": bool(torch.equal(total, want_total)), "normed_max_rel": float(relative)}
        ok = ok and case["sums_equal"] and case["normed_max_rel"] <= tolerance
        out[str(dtype)[6:]] = case
    return {"ok": ok, **out}

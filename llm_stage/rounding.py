"""Rounding to a half-precision dtype inside our Triton kernels, the same on the GPU and in
Triton's interpreter, so the fused kernels give the torch ops' bits and the tests can prove it.

A plain `x.to(tl.bfloat16)` rounds to nearest even on the GPU but toward zero in Triton 3.6's
interpreter (the tests run kernels there, on the CPU): `rounded` does bf16 by integer arithmetic.
"""

from __future__ import annotations

import torch

from llm_stage.attention import triton_available

ROUND_CODES = {torch.bfloat16: 1, torch.float16: 2}  # the kernels' ROUND constexpr per dtype; fp32: 0

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def rounded(x, ROUND: tl.constexpr):
        """fp32 `x` rounded to nearest even in the dtype ROUND names (0 fp32: as is, 1 bf16, 2 fp16),
        kept in fp32 (finite values)."""
        if ROUND == 1:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif ROUND == 2:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

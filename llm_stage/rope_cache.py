"""Rotary embedding of queries and keys and the slot-cache write of keys and values, in one kernel.

Per layer and step, the torch ops for this part are ~9 kernels (two products, a negation, a
concatenation and a sum for the rotation; two copies to flatten K and V; two indexed writes into
the cache). In a captured decode graph of Orpheus 3B's 28 layers that is ~250 of its ~900 nodes:
on an H200 (2026-12-04, `docs/experiments/2026-12-04-gpu-decode-step.md`) the step's small kernels
took ~1.6 ms of its 4.5 ms of GPU time and each graph launch ~1.7 ms of host time, both growing
with the node count. One Triton program per (token, head) rotates its head and writes it where it
goes: rotated queries to a new [N, Hq, D] tensor, rotated keys and plain values into the cache.

The rotation rounds like the torch ops it replaces (each product and the sum rounded to the input
dtype in turn: `x * cos + rotate_half(x) * sin`), so the fused path gives the unfused path's bits.
Why our own kernel: vLLM's `rotary_embedding` + `reshape_and_cache` and FlashInfer's
`apply_rope_with_cos_sin_cache` + `append_paged_kv_cache` do this, but neither package can be
brought to the GPU lent for our measurements (torch 2.11, no network) and our cache layout is
the slot cache's. Used by `LlamaBackbone` on CUDA when Triton is there and the model has no
per-head q/k norms; elsewhere the torch ops run.
"""

from __future__ import annotations

import functools
import os

import torch

from llm_stage.attention import next_pow2, triton_available
from llm_stage.kernel_check import passes_on_gpu
from llm_stage.kv_cache import PagedKVCache
from llm_stage.rounding import ROUND_CODES, rounded

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_and_cache(
        qkv_ptr, cos_ptr, sin_ptr, slots_ptr, positions_ptr, table_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
        stride_qkv, stride_cos, stride_q_token, stride_q_head,
        stride_ks, stride_kh, stride_kl, stride_vs, stride_vh, stride_vl, stride_t,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
        ROUND: tl.constexpr, PAGE: tl.constexpr,
    ):  # fmt: skip
        """Program (token, head): heads [0, Hq) queries, [Hq, Hq + Hkv) keys, then values. PAGE > 0:
        the cache is block pools and (slot, position) goes to (table[slot, position // PAGE], position % PAGE)."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < HALF
        row = qkv_ptr + token * stride_qkv + head * 2 * HALF
        first = tl.load(row + offsets, mask=inside, other=0.0)
        second = tl.load(row + HALF + offsets, mask=inside, other=0.0)
        dtype = first.dtype
        if head < NUM_HEADS + NUM_KV_HEADS:  # rotate: x * cos + rotate_half(x) * sin, rounded as torch rounds
            cos_row = cos_ptr + token * stride_cos
            sin_row = sin_ptr + token * stride_cos
            cos_first = tl.load(cos_row + offsets, mask=inside, other=0.0).to(tl.float32)
            cos_second = tl.load(cos_row + HALF + offsets, mask=inside, other=0.0).to(tl.float32)
            sin_first = tl.load(sin_row + offsets, mask=inside, other=0.0).to(tl.float32)
            sin_second = tl.load(sin_row + HALF + offsets, mask=inside, other=0.0).to(tl.float32)
            x1 = first.to(tl.float32)
            x2 = second.to(tl.float32)
            out_first = rounded(x1 * cos_first, ROUND) + rounded((-x2) * sin_first, ROUND)
            out_second = rounded(x2 * cos_second, ROUND) + rounded(x1 * sin_second, ROUND)
            first = rounded(out_first, ROUND).to(dtype)  # (exact: already a value of `dtype`)
            second = rounded(out_second, ROUND).to(dtype)
        if head < NUM_HEADS:
            out = q_out_ptr + token * stride_q_token + head * stride_q_head
            tl.store(out + offsets, first, mask=inside)
            tl.store(out + HALF + offsets, second, mask=inside)
        else:
            slot = tl.load(slots_ptr + token).to(tl.int64)
            position = tl.load(positions_ptr + token).to(tl.int64)
            if PAGE > 0:
                slot = tl.load(table_ptr + slot * stride_t + position // PAGE).to(tl.int64)
                position = position % PAGE
            if head < NUM_HEADS + NUM_KV_HEADS:
                kv_head = head - NUM_HEADS
                out = k_cache_ptr + slot * stride_ks + kv_head * stride_kh + position * stride_kl
            else:
                kv_head = head - NUM_HEADS - NUM_KV_HEADS
                out = v_cache_ptr + slot * stride_vs + kv_head * stride_vh + position * stride_vl
            tl.store(out + offsets, first, mask=inside)
            tl.store(out + HALF + offsets, second, mask=inside)


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [N, (Hq + 2 Hkv) * D] (one row per token, last dim contiguous); cos / sin [N, D]; slots /
    positions [N] where each token's K and V go in `k_layer` / `v_layer` ([S, Hkv, L, D]; with a
    block `table` [S, M], block pools [N, Hkv, block_size, D]).
    Returns the rotated queries [N, Hq, D]; writes the rotated keys and the values into the cache."""
    tokens, dim = qkv.shape[0], k_layer.shape[-1]
    queries = torch.empty(tokens, num_heads, dim, dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)  # (as transformers' rotary embedding casts them)
    half = dim // 2
    _rope_and_cache[(tokens, num_heads + 2 * num_kv_heads)](
        qkv, cos, sin, slots, positions, slots if table is None else table, queries, k_layer, v_layer,
        qkv.stride(0), cos.stride(0), queries.stride(0), queries.stride(1),
        k_layer.stride(0), k_layer.stride(1), k_layer.stride(2),
        v_layer.stride(0), v_layer.stride(1), v_layer.stride(2), 0 if table is None else table.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK=next_pow2(half, 16),
        ROUND=ROUND_CODES.get(qkv.dtype, 0), PAGE=0 if table is None else k_layer.shape[2],
    )  # fmt: skip
    return queries


@functools.cache
def fused_rope_works(device_index: int) -> bool:
    """Whether the kernel compiles and gives the torch ops' bits on this GPU (checked once per
    process, small bf16 shapes); otherwise the backbone keeps the torch ops, and says so."""
    return passes_on_gpu("rotary + cache write", lambda: rope_parity(torch.device("cuda", device_index), small=True))


def rope_parity(device: str | torch.device = "cuda", seed: int = 0, small: bool = False) -> dict:
    """The fused kernel against the torch ops at Orpheus 3B's head shapes in bf16 (and fp32):
    {"ok": bool, per dtype whether queries, keys and values are the same bits; `paged`: the same
    through a paged cache's block table}. On a CPU only under Triton's interpreter."""
    from llm_stage.models.llama import apply_rotary

    device = torch.device(device)
    if not triton_available() or not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return {"ok": True, "skipped": "the Triton kernel runs on CUDA only"}
    gen = torch.Generator().manual_seed(seed)
    tokens, heads, kv_heads, dim, slots_total, max_len = (9, 4, 2, 64, 4, 16) if small else (300, 24, 8, 128, 40, 512)
    out: dict = {}
    for dtype in (torch.bfloat16, torch.float32):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
        angles = torch.rand(tokens, dim // 2, generator=gen).to(device) * 100.0
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
        cells = torch.randperm(slots_total * max_len, generator=gen)[:tokens].to(device)
        slots, positions = cells // max_len, cells % max_len
        caches = [torch.zeros(slots_total, kv_heads, max_len, dim, dtype=dtype, device=device) for _ in range(4)]
        queries = rope_and_cache(qkv, cos, sin, slots, positions, caches[0], caches[1], heads, kv_heads)
        split = qkv.view(tokens, 1, heads + 2 * kv_heads, dim).transpose(1, 2)
        rotated = apply_rotary(split[:, : heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))
        caches[2][slots, :, positions] = rotated[:, heads:, 0]
        caches[3][slots, :, positions] = split[:, heads + kv_heads :, 0]
        out[str(dtype)[6:]] = {
            "queries_max_abs": float((queries.float() - rotated[:, :heads, 0].float()).abs().max()),
            "keys_max_abs": float((caches[0].float() - caches[2].float()).abs().max()),
            "values_equal": bool(torch.equal(caches[1], caches[3])),
        }
    out["paged"] = paged_rope_parity(device, gen, small)
    bf16 = out["bfloat16"]
    ok = bf16["queries_max_abs"] == 0 and bf16["keys_max_abs"] == 0 and bf16["values_equal"]
    ok = ok and out["float32"]["queries_max_abs"] < 1e-5 and out["float32"]["values_equal"]
    return {"ok": ok and all(out["paged"].values()), **out}


def paged_rope_parity(device: torch.device, gen: torch.Generator, small: bool) -> dict[str, bool]:
    """The kernel writing through a paged cache's block table (bf16, blocks of 16 assigned in
    shuffled order) against the torch ops' `PagedKVCache.write`: the same bits everywhere."""
    from llm_stage.models.llama import apply_rotary

    tokens, heads, kv_heads, dim, slots_total, max_len = (9, 4, 2, 64, 4, 64) if small else (300, 24, 8, 128, 40, 512)
    block_size, dtype = 16, torch.bfloat16
    blocks_per_slot = max_len // block_size
    num_blocks = slots_total * blocks_per_slot
    order = torch.randperm(num_blocks, generator=gen).tolist()
    caches = []
    for _ in range(2):
        cache = PagedKVCache(1, slots_total, kv_heads, max_len, dim, dtype, device, num_blocks, block_size)
        for slot in range(slots_total):
            cache.assign(slot, order[slot * blocks_per_slot : (slot + 1) * blocks_per_slot])
        pending = cache.take_pending()
        if pending is not None:  # (on CUDA the runner copies changed table rows in each step's one copy)
            cache.table.index_copy_(0, pending[0].to(device), pending[1].to(device))
        caches.append(cache)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    angles = torch.rand(tokens, dim // 2, generator=gen).to(device) * 100.0
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    cells = torch.randperm(slots_total * max_len, generator=gen)[:tokens].to(device)
    slots, positions = cells // max_len, cells % max_len
    fused, reference = caches
    queries = rope_and_cache(qkv, cos, sin, slots, positions, *fused.layer(0), heads, kv_heads, fused.table)
    split = qkv.view(tokens, 1, heads + 2 * kv_heads, dim).transpose(1, 2)
    rotated = apply_rotary(split[:, : heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))
    reference.write(0, slots, positions, rotated[:, heads:, 0], split[:, heads + kv_heads :, 0])
    return {
        "queries_equal": bool(torch.equal(queries, rotated[:, :heads, 0])),
        "keys_equal": bool(torch.equal(fused.keys, reference.keys)),
        "values_equal": bool(torch.equal(fused.values, reference.values)),
    }

"""Decode attention that reads each row's own tokens in place in the slot KV cache.

One query token per row attends to positions [0, seq_len) of its own cache row; `seq_lens` live on
the device, so one captured CUDA graph per batch size serves every length and a step reads only
the tokens that are cached, not whole `max_seq_len` rows (the old path gathered every row whole in
every layer: a step's cost followed the cache's size, 3.5x at 4096 vs 256 tokens on an H200).

On CUDA this is a split-K ("flash-decoding") Triton kernel: program (row, KV head, split) runs an
online softmax over its share of the row's tokens for the GQA group of query heads that share the
KV head (one `tl.dot` per 64-token block, so K and V are read once per group, not once per query
head), and a second small kernel merges the splits by their log-sum-exp. The split count is fixed
per batch size (enough programs to fill the chip); each row's tokens are shared out among the
splits at run time from its own length.

Why our own kernel: torch 2.13's `torch.nn.attention.varlen.varlen_attn(seqused_k=, block_table=)`
is FlashAttention's paged decode, but the GPU lent for our measurements runs torch 2.11, whose
`varlen_attn` has neither argument, and FlashInfer's wheel (101 MB) cannot be brought to it;
flash-attn's own package needs a build per torch / CUDA pair. Triton comes with every CUDA build of
torch, so this kernel runs wherever torch runs on CUDA and is what the GPU figures measure. On
CPU, or CUDA without Triton, `decode_attention` runs SDPA over the batch's longest row (masked per
row; while a CUDA graph is being captured, over the whole row, the only static length).
`attention_parity` checks the kernel against SDPA, on slot rows and paged (for `loadtest.gpu_bench`).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from llm_stage.kv_cache import gather_pages

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None
    tl = None

BLOCK_N = 64  # cache positions per inner-loop block
MAX_SPLITS = 32


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _decode_partials(
        q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, table_ptr, out_ptr, lse_ptr,
        scale,
        stride_qb, stride_qh,
        stride_ks, stride_kh, stride_kl,
        stride_vs, stride_vh, stride_vl,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh, stride_t,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr, PRECISION: tl.constexpr,
        PAGE: tl.constexpr,
    ):  # fmt: skip
        """One (row, KV head, split): softmax-weighted V over the split's tokens for the GQA group.
        PAGE = 0: k/v are slot rows ([S, H, L, D], row `slot`); PAGE > 0: block pools ([N, H, PAGE, D])
        and position p of the row lives in block table[slot, p // PAGE] at offset p % PAGE."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + row)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        blocks_per_split = ((seq_len + BLOCK - 1) // BLOCK + NUM_SPLITS - 1) // NUM_SPLITS
        start = split * blocks_per_split * BLOCK
        end = tl.minimum(start + blocks_per_split * BLOCK, seq_len)

        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, BLOCK_D)
        offsets = tl.arange(0, BLOCK)
        heads = kv_head * GROUP + group
        head_mask = (group < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=head_mask, other=0.0)
        k_head = k_ptr + kv_head * stride_kh
        v_head = v_ptr + kv_head * stride_vh
        table_row = table_ptr + slot * stride_t

        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        for block_start in range(start, end, BLOCK):
            positions = block_start + offsets
            valid = positions < end
            kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
            if PAGE > 0:  # each position's block from the slot's row of the block table
                cells = tl.load(table_row + positions // PAGE, mask=valid, other=0).to(tl.int64)
                offsets_in = positions % PAGE
            else:
                cells = tl.zeros([BLOCK], tl.int64) + slot
                offsets_in = positions
            k_ptrs = k_head + cells[:, None] * stride_ks + offsets_in[:, None] * stride_kl + dims[None, :]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            rescale = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best[:, None])
            total = total * rescale + tl.sum(weights, 1)
            v_ptrs = v_head + cells[:, None] * stride_vs + offsets_in[:, None] * stride_vl + dims[None, :]
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            best = new_best

        has_tokens = start < seq_len  # an empty split writes nothing; the merge skips it
        safe_total = tl.where(total > 0, total, 1.0)
        out = acc / safe_total[:, None]
        out_ptrs = out_ptr + row * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask & has_tokens)
        if WRITE_LSE:
            lse = best + tl.log(safe_total)
            tl.store(lse_ptr + row * stride_lb + heads * stride_lh + split, lse, mask=(group < GROUP) & has_tokens)

    @triton.jit
    def _merge_splits(
        part_ptr, lse_ptr, lens_ptr, out_ptr,
        stride_pb, stride_ph, stride_ps,
        stride_lb, stride_lh,
        stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
        NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):  # fmt: skip
        """One (row, query head): the splits' outputs weighted by exp(lse - max lse)."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        seq_len = tl.load(lens_ptr + row)
        num_blocks = (seq_len + BLOCK - 1) // BLOCK  # (plain integer ceilings: tl.cdiv is not interpretable)
        blocks_per_split = (num_blocks + NUM_SPLITS - 1) // NUM_SPLITS
        used = (num_blocks + blocks_per_split - 1) // blocks_per_split  # splits that hold tokens (the first `used`)
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, BLOCK_D)
        valid = splits < used
        lse = tl.load(lse_ptr + row * stride_lb + head * stride_lh + splits, mask=valid, other=float("-inf"))
        weights = tl.where(valid, tl.exp(lse - tl.max(lse, 0)), 0.0)
        part_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        part_ptrs = part_ptr + row * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :]
        parts = tl.load(part_ptrs, mask=part_mask, other=0.0)
        out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
        out_ptrs = out_ptr + row * stride_ob + head * stride_oh + dims
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(rows: int, kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """Splits per (row, KV head): about two programs per multiprocessor, a power of two (fewer
    compiled variants), no more than the cache row has blocks."""
    wanted = max(1, math.ceil(2 * sm_count / max(1, rows * kv_heads)))
    splits = 1 << (wanted - 1).bit_length()
    return max(1, min(splits, MAX_SPLITS, math.ceil(max_seq_len / BLOCK_N)))


def next_pow2(value: int, floor: int) -> int:
    """The smallest power of two >= `value`, at least `floor` (Triton block sizes)."""
    return max(floor, 1 << (value - 1).bit_length())


def decode_attention_triton(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; k/v_layer [S, Hkv, L, D] (one layer of the slot cache, last dim contiguous), or
    with a block `table` [S, M] (int32) one layer's block pools [N, Hkv, block_size, D]; slots [B]
    cache rows; seq_lens [B] int32 tokens to attend per row (>= 1) -> [B, Hq, D].
    Under TRITON_INTERPRET=1 (set before triton is imported) the kernels run on CPU tensors: tests."""
    rows, heads, dim = q.shape
    kv_heads = k_layer.shape[1]
    page = 0 if table is None else k_layer.shape[2]
    max_len = k_layer.shape[2] if table is None else table.shape[1] * page
    group = heads // kv_heads
    if splits is None:
        sm_count = _sm_count(q.device.index or 0) if q.is_cuda else 4
        splits = num_splits(rows, kv_heads, max_len, sm_count)
    out = torch.empty_like(q)
    block_d = next_pow2(dim, 16)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if splits == 1:
        part, lse, part_strides, lse_strides = out, out, (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        part = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride()[:3], lse.stride()[:2]
    table_arg = slots if table is None else table  # (unread without a table)
    _decode_partials[(rows, kv_heads, splits)](
        q, k_layer, v_layer, slots, seq_lens, table_arg, part, lse, scale,
        q.stride(0), q.stride(1),
        k_layer.stride(0), k_layer.stride(1), k_layer.stride(2),
        v_layer.stride(0), v_layer.stride(1), v_layer.stride(2),
        *part_strides, *lse_strides, 0 if table is None else table.stride(0),
        GROUP=group, GROUP_PAD=next_pow2(group, 16), HEAD_DIM=dim, BLOCK_D=block_d, BLOCK=BLOCK_N,
        NUM_SPLITS=splits, WRITE_LSE=splits > 1, PRECISION=precision, PAGE=page,
    )  # fmt: skip
    if splits > 1:
        _merge_splits[(rows, heads)](
            part, lse, seq_lens, out, *part.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
            HEAD_DIM=dim, BLOCK_D=block_d, BLOCK=BLOCK_N, NUM_SPLITS=splits, SPLITS_PAD=next_pow2(splits, 1),
        )  # fmt: skip
    return out


def decode_attention_sdpa(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    length: int | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same as `decode_attention_triton` with torch ops: SDPA over the first `length` positions
    of each row (default: the longest row, read on the host), masked to each row's own length; with
    a block `table`, those positions' blocks gathered first (`gather_pages`)."""
    if length is None:
        length = int(seq_lens.max())
    if table is None:
        keys = k_layer[:, :, :length].index_select(0, slots)  # [B, Hkv, L, D]
        values = v_layer[:, :, :length].index_select(0, slots)
    else:
        keys, values = gather_pages(k_layer, table, slots, length), gather_pages(v_layer, table, slots, length)
    mask = torch.arange(length, device=q.device).view(1, 1, 1, -1) < seq_lens.view(-1, 1, 1, 1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def decode_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row attending to its own cached tokens: [B, Hq, D] (see the module doc).
    `table`: the paged cache's block table (k/v_layer are then block pools)."""
    if q.is_cuda and triton is not None:
        return decode_attention_triton(q, k_layer, v_layer, slots, seq_lens, scale, table=table)
    whole_row = k_layer.shape[2] if table is None else table.shape[1] * k_layer.shape[2]
    length = whole_row if _capturing(q.device) else None  # no host read inside a capture
    return decode_attention_sdpa(q, k_layer, v_layer, slots, seq_lens, scale, length, table)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def as_pages(
    layers: tuple[torch.Tensor, ...], block_size: int, gen: torch.Generator
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Slot rows [S, H, L, D] (keys, values; L a multiple of `block_size`) as a paged layer: for each
    a block pool [S * L / bs + 1, H, bs, D] holding its rows in shuffled blocks (the last one
    scratch, random), and the one block table [S, L / bs] (int32) that finds them, on their device."""
    slots, heads, length, dim = layers[0].shape
    width = length // block_size
    device, dtype = layers[0].device, layers[0].dtype
    table = torch.randperm(slots * width, generator=gen).view(slots, width).to(device, torch.int32)
    pools = []
    for rows in layers:
        pool = torch.randn(slots * width + 1, heads, block_size, dim, generator=gen).to(device, dtype)
        pool[table.flatten().long()] = rows.view(slots, heads, width, block_size, dim).transpose(1, 2).flatten(0, 1)
        pools.append(pool)
    return pools, table


PARITY_CASES = ((1, 4096, torch.bfloat16), (37, 1024, torch.bfloat16), (128, 512, torch.float32))
SMALL_PARITY_CASES = ((1, 256, torch.float32), (5, 128, torch.float32))  # (the interpreter has no bf16 dot)
PARITY_BLOCK_SIZE = 16  # the paged layout's default block


def attention_parity(device: str | torch.device = "cuda", seed: int = 0, small: bool = False) -> dict:
    """The decode kernel against SDPA over the same tokens at mixed lengths (padding rows, GQA),
    at Orpheus 3B's head shapes in the cache's dtype, on slot rows and through a paged layer's
    shuffled block table (`paged/` cases: the same tokens); {"ok": bool, per case the max abs
    error}. `small`: fewer rows and heads, for Triton's interpreter on a CPU."""
    device = torch.device(device)
    if triton is None or not (device.type == "cuda" or _interpreted()):
        return {"ok": True, "skipped": "the Triton kernel runs on CUDA only"}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cases = {}
    kv_heads, heads, dim = (2, 6, 64) if small else (8, 24, 128)
    for rows, max_len, dtype in SMALL_PARITY_CASES if small else PARITY_CASES:
        slots_total = rows + 3
        shape = (slots_total, kv_heads, max_len, dim)
        k = torch.randn(shape, generator=gen).to(device, dtype)
        v = torch.randn(shape, generator=gen).to(device, dtype)
        q = torch.randn(rows, heads, dim, generator=gen).to(device, dtype)
        slots = torch.randperm(slots_total, generator=gen)[:rows].to(device)
        lens = torch.randint(1, max_len + 1, (rows,), generator=gen).to(device, torch.int32)
        want = decode_attention_sdpa(q.float(), k.float(), v.float(), slots, lens, dim**-0.5).float()
        got = decode_attention_triton(q, k, v, slots, lens, dim**-0.5).float()
        name = f"{rows}x{max_len}/{str(dtype)[6:]}"
        cases[name] = float((got - want).abs().max())
        (k_pool, v_pool), table = as_pages((k, v), PARITY_BLOCK_SIZE, gen)
        paged = decode_attention_triton(q, k_pool, v_pool, slots, lens, dim**-0.5, table=table).float()
        cases[f"paged/{name}"] = float((paged - want).abs().max())
    tolerance = {"bfloat16": 2e-2, "float32": 1e-4}
    ok = all(err <= tolerance[name.split("/")[-1]] for name, err in cases.items())
    return {"ok": ok, "max_abs_err": cases}

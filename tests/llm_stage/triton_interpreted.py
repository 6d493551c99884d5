"""Runs our Triton kernels in Triton's interpreter (CPU tensors) and prints JSON: for
`llm_stage.attention`, per case the max abs difference from SDPA over each row's own tokens and
the K / V elements the kernel loaded against the tokens cached; for `llm_stage.rope_cache`,
whether the fused rotation + cache write gives the torch ops' bits (fp32 and bf16; through a block
table too), and whether an engine's greedy tokens are the same with it; the decode kernel over a
paged cache (block pools + a shuffled block table) against SDPA over the same tokens, loads
counted; the parity checks a GPU run makes (`attention_parity`, `rope_parity`) at small shapes.
Run with TRITON_INTERPRET=1 in the environment (Triton reads it at import):
`test_decode_attention.py` starts it in a subprocess.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import triton.runtime.interpreter as interpreter

from llm_stage.add_norm import add_rms_norm, reference_add_rms_norm
from llm_stage.attention import attention_parity, decode_attention_sdpa, decode_attention_triton
from llm_stage.kv_cache import PagedKVCache
from llm_stage.models.llama import apply_rotary
from llm_stage.rope_cache import rope_and_cache, rope_parity


def _index_scalars_as_numpy_2_wants() -> None:
    """Triton 3.6's interpreter turns a scalar (a 1-element array) into a loop bound with
    int(array), which numpy >= 2.4 refuses for arrays of one dimension: take the element."""
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


class LoadCounter:
    """Counts the elements the kernels load (mask true) inside each watched tensor."""

    def __init__(self) -> None:
        self.ranges: dict[str, tuple[int, int]] = {}
        self.counts: dict[str, int] = {}
        original = interpreter.InterpreterBuilder.create_masked_load

        def counting(builder, ptrs, mask, other, *rest):
            addresses = ptrs.data[mask.data.astype(bool)] if mask is not None else ptrs.data.ravel()
            for name, (low, high) in self.ranges.items():
                self.counts[name] += int(np.count_nonzero((addresses >= low) & (addresses < high)))
            return original(builder, ptrs, mask, other, *rest)

        interpreter.InterpreterBuilder.create_masked_load = counting

    def watch(self, **tensors: torch.Tensor) -> None:
        self.ranges = {n: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for n, t in tensors.items()}
        self.counts = dict.fromkeys(tensors, 0)


def run_case(counter: LoadCounter, rows, max_len, kv_heads, heads, dim, splits, seed) -> dict:
    gen = torch.Generator().manual_seed(seed)
    num_slots = rows + 2  # the last one a scratch slot, as in the cache
    slots = torch.randperm(num_slots - 1, generator=gen)[:rows]
    lens = torch.randint(1, 251, (rows,), generator=gen).to(torch.int32)  # the same whatever `max_len`
    q = torch.randn(rows, heads, dim, generator=gen)
    keys = torch.randn(num_slots, kv_heads, max_len, dim, generator=gen)
    values = torch.randn(num_slots, kv_heads, max_len, dim, generator=gen)
    slots[-1], lens[-1] = num_slots - 1, 1  # a graph's padding row: the scratch slot, one position
    counter.watch(keys=keys, values=values)
    got = decode_attention_triton(q, keys, values, slots, lens, dim**-0.5, splits=splits)
    want = decode_attention_sdpa(q, keys, values, slots, lens, dim**-0.5)
    cached = int(lens.sum()) * kv_heads * dim
    return {
        "max_abs_err": float((got - want).abs().max()),
        "keys_loaded": counter.counts["keys"],
        "values_loaded": counter.counts["values"],
        "cached_elements": cached,
        "lens": lens.tolist(),
    }


def paged(slot_rows: torch.Tensor, block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot rows [S, H, L, D] as a block pool [S * L / bs + 1, H, bs, D] (blocks shuffled, the
    last one scratch) and its block table [S, L / bs]."""
    slots, heads, length, dim = slot_rows.shape
    width = length // block_size
    table = torch.randperm(slots * width, generator=gen).view(slots, width).to(torch.int32)
    pool = torch.randn(slots * width + 1, heads, block_size, dim, generator=gen)
    pool[table.flatten().long()] = slot_rows.view(slots, heads, width, block_size, dim).transpose(1, 2).flatten(0, 1)
    return pool, table


def paged_case(counter: LoadCounter, rows, max_len, block_size, splits, seed) -> dict:
    """The kernel over a block pool + table against SDPA over the same tokens in slot rows: GQA 3,
    mixed lengths, a padding row; its K / V loads against the tokens cached."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, heads, dim, num_slots = 2, 6, 64, rows + 2
    slots = torch.randperm(num_slots - 1, generator=gen)[:rows]
    lens = torch.randint(1, 251, (rows,), generator=gen).to(torch.int32)
    slots[-1], lens[-1] = num_slots - 1, 1
    q = torch.randn(rows, heads, dim, generator=gen)
    keys = torch.randn(num_slots, kv_heads, max_len, dim, generator=gen)
    values = torch.randn(num_slots, kv_heads, max_len, dim, generator=gen)
    key_pool, table = paged(keys, block_size, gen)
    value_pool = torch.randn_like(key_pool)
    value_pool[table.flatten().long()] = (
        values.view(num_slots, kv_heads, -1, block_size, dim).transpose(1, 2).flatten(0, 1)
    )
    counter.watch(keys=key_pool, values=value_pool)
    got = decode_attention_triton(q, key_pool, value_pool, slots, lens, dim**-0.5, splits=splits, table=table)
    want = decode_attention_sdpa(q, keys, values, slots, lens, dim**-0.5)
    torch_paged = decode_attention_sdpa(q, key_pool, value_pool, slots, lens, dim**-0.5, table=table)
    return {
        "max_abs_err": float((got - want).abs().max()),
        "torch_paged_err": float((torch_paged - want).abs().max()),
        "keys_loaded": counter.counts["keys"],
        "values_loaded": counter.counts["values"],
        "cached_elements": int(lens.sum()) * kv_heads * dim,
    }


def rope_paged_case(seed: int = 0) -> dict:
    """The fused kernel writing through a block table against `PagedKVCache.write` (torch ops), fp32."""
    gen = torch.Generator().manual_seed(seed)
    tokens, heads, kv_heads, dim, slots_total, max_len, block_size = 7, 6, 2, 64, 4, 32, 8
    caches = [
        PagedKVCache(1, slots_total, kv_heads, max_len, dim, torch.float32, "cpu", 16, block_size) for _ in range(2)
    ]
    blocks = torch.randperm(16, generator=gen).tolist()
    for cache in caches:
        for slot in range(slots_total):
            cache.assign(slot, blocks[slot * 4 : slot * 4 + 4])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    cells = torch.randperm(slots_total * max_len, generator=gen)[:tokens]
    slots, positions = cells // max_len, cells % max_len
    fused = caches[0]
    queries = rope_and_cache(qkv, cos, sin, slots, positions, *fused.layer(0), heads, kv_heads, fused.table)
    split = qkv.view(tokens, 1, heads + 2 * kv_heads, dim).transpose(1, 2)
    rotated = apply_rotary(split[:, : heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))
    caches[1].write(0, slots, positions, rotated[:, heads:, 0], split[:, heads + kv_heads :, 0])
    return {
        "queries_equal": bool(torch.equal(queries, rotated[:, :heads, 0])),
        "keys_equal": bool(torch.equal(fused.keys, caches[1].keys)),
        "values_equal": bool(torch.equal(fused.values, caches[1].values)),
        "keys_written": int((fused.keys != 0).any(-1).sum()),
    }


def rope_case(dtype: torch.dtype, seed: int = 0) -> dict:
    """The fused kernel against apply_rotary + indexed cache writes on the same inputs."""
    gen = torch.Generator().manual_seed(seed)
    tokens, heads, kv_heads, dim, slots_total, max_len = 7, 6, 2, 80, 5, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1).to(dtype), torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    cells = torch.randperm(slots_total * max_len, generator=gen)[:tokens]
    slots, positions = cells // max_len, cells % max_len
    caches = [torch.zeros(slots_total, kv_heads, max_len, dim, dtype=dtype) for _ in range(4)]
    queries = rope_and_cache(qkv, cos, sin, slots, positions, caches[0], caches[1], heads, kv_heads)
    split = qkv.view(tokens, 1, heads + 2 * kv_heads, dim).transpose(1, 2)  # [N, H, 1, D]
    rotated = apply_rotary(split[:, : heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))
    caches[2][slots, :, positions] = rotated[:, heads:, 0]
    caches[3][slots, :, positions] = split[:, heads + kv_heads :, 0]
    return {
        "queries_equal": bool(torch.equal(queries, rotated[:, :heads, 0])),
        "keys_equal": bool(torch.equal(caches[0], caches[2])),
        "values_equal": bool(torch.equal(caches[1], caches[3])),
        "keys_written": int((caches[0] != 0).any(-1).sum()),
    }


def fused_engine_tokens() -> dict:
    """Greedy and seeded tokens of the orpheus-tiny engine with and without the fused kernels."""
    from tests.factories import orpheus_engine

    runs = {}
    for fused in (False, True):
        engine = orpheus_engine(num_slots=4, prefill_token_budget=64)
        backbone = engine.adapter.backbone
        backbone.fuse_rope_cache = backbone.fuse_add_norm = fused
        engine.add_request("greedy", "fused or not", None, {"temperature": 0.0, "max_tokens": 9})
        engine.add_request("seeded", "the same words", None, {"seed": 3, "max_tokens": 9})
        runs[fused] = engine.run_to_completion()
        backbone.fuse_rope_cache = backbone.fuse_add_norm = None
    return {"same_tokens": runs[False] == runs[True], "tokens": len(runs[True]["greedy"])}


def add_norm_case(dtype: torch.dtype, seed: int = 0) -> dict:
    """The fused add + RMSNorm against the torch ops: sums bit-equal; normalised values' largest
    difference, relative, and the share of them not bit-equal."""
    gen = torch.Generator().manual_seed(seed)
    rows, hidden = 6, 200
    residual = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    total, normed = add_rms_norm(residual, delta, weight, 1e-5)
    want_total, want_normed = reference_add_rms_norm(residual, delta, weight, 1e-5)
    relative = (normed.float() - want_normed.float()).abs() / want_normed.float().abs().clamp(min=1e-3)
    return {
        "sums_equal": bool(torch.equal(total, want_total)),
        "normed_max_rel": float(relative.max()),
        "normed_unequal_share": float((normed != want_normed).float().mean()),
    }


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    _index_scalars_as_numpy_2_wants()
    counter = LoadCounter()
    cases = {  # rows, max_len, kv heads, query heads, head dim, splits
        "one_split_gqa2": (5, 300, 2, 4, 64, 1),
        "splits_gqa3_d128": (4, 320, 2, 6, 128, 3),
        "odd_dim80_gqa4": (3, 200, 1, 4, 80, 2),
        "short_cache_256": (4, 256, 2, 4, 64, 4),
        "long_cache_4096": (4, 4096, 2, 4, 64, 4),
    }
    seeds = {name: 1 if "cache" in name else i for i, name in enumerate(cases)}  # the two caches: the same rows
    out = {name: run_case(counter, *shape, seed=seeds[name]) for name, shape in cases.items()}
    out["rope_float32"] = rope_case(torch.float32)
    out["rope_bfloat16"] = rope_case(torch.bfloat16)
    out["rope_engine"] = fused_engine_tokens()
    out["rope_paged"] = rope_paged_case()
    paged_cases = {  # rows, max_len, block size, splits: the same rows at 256 and 4096
        "paged_bs16_short_256": (4, 256, 16, 4),
        "paged_bs16_long_4096": (4, 4096, 16, 4),
        "paged_bs5_one_split": (3, 300, 5, 1),
    }
    out["paged"] = {name: paged_case(counter, *shape, seed=1) for name, shape in paged_cases.items()}
    # the GPU run's own checks (loadtest.gpu_bench, kernel_check), slot and paged, at small fp32 shapes here
    out["gpu_checks"] = {"attention": attention_parity("cpu", small=True), "rope": rope_parity("cpu", small=True)}
    out["add_norm_float32"] = add_norm_case(torch.float32)
    out["add_norm_bfloat16"] = add_norm_case(torch.bfloat16)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

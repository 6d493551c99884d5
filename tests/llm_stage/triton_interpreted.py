"""Runs `llm_stage.attention`'s Triton kernels in Triton's interpreter (CPU tensors) and prints
JSON: per case the max abs difference from SDPA over each row's own tokens, and the K / V
elements the kernel loaded against the tokens cached. Run with TRITON_INTERPRET=1 in the
environment (Triton reads it at import): `test_decode_attention.py` starts it in a subprocess.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import triton.runtime.interpreter as interpreter

from llm_stage.attention import decode_attention_sdpa, decode_attention_triton


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
    print(json.dumps(out))


if __name__ == "__main__":
    main()

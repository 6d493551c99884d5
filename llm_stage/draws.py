"""Counter-based random draws: a uniform for (seed, draw counter, column) by integer hashing.

Every sampler (torch on any device, numpy on the host, repetition-aware) takes its uniforms here,
so a seeded stream draws the same numbers wherever it runs: in any batch, on any replica, after a
resume (its counter is the row's draw index, `draw_counter`), with no generator state to carry
and nothing drawn on the host per row. The hash is murmur3's 32-bit finaliser on int64 values
kept under 2^32 (products split in 16-bit halves, so nothing overflows): the same bits from Python
ints, numpy arrays and torch tensors on any device (numpy's host path runs the same function on
uint32 arrays, whose products wrap mod 2^32 natively: a third of the operations).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
MAX_CODEBOOKS = 64  # codebooks drawn per step and row, at most (their counters interleave)
_GOLDEN = 0x9E3779B9


def _mul32(x, constant: int):
    """(x * constant) mod 2^32 for x in [0, 2^32), with no intermediate past 2^49."""
    low, high = x & 0xFFFF, x >> 16
    return (low * constant + (((high * constant) & 0xFFFF) << 16)) & MASK32


def fmix32(x):
    """murmur3's finaliser: every input bit flips each output bit with probability ~1/2."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def draw_counter(num_drawn: int, codebook: int = 0) -> int:
    """A row's counter for its next draw: tokens it drew before, interleaved by codebook."""
    return num_drawn * MAX_CODEBOOKS + codebook


def seed_halves(seed: int) -> tuple[int, int]:
    return seed & MASK32, (seed >> 32) & MASK32


def row_keys(seed_low, seed_high, counter):
    """Per row: 32 well-mixed bits for (seed, counter); ints, numpy int64 or torch int64 alike."""
    key = fmix32(fmix32(seed_low ^ _GOLDEN) ^ seed_high)
    return fmix32(key ^ (counter & MASK32))


def row_key(seed: int, counter: int) -> int:
    low, high = seed_halves(seed)
    return row_keys(low, high, counter)


def _fmix32_u32(x: np.ndarray) -> np.ndarray:
    """`fmix32` on a uint32 array (products wrap mod 2^32 by themselves): the same bits."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def _bits_to_uniform_np(bits: np.ndarray) -> np.ndarray:
    return ((bits >> np.uint32(9)).astype(np.float32) * np.float32(2.0) + np.float32(1.0)) * np.float32(2.0**-24)


def uniforms_np(keys: np.ndarray, width: int) -> np.ndarray:
    """[R, width] float32 uniforms in (0, 1) (odd multiples of 2^-24) for per-row `keys` [R]."""
    bits = _fmix32_u32(np.asarray(keys, dtype=np.uint32)[:, None] ^ _column_hashes_np(width)[None, :])
    return _bits_to_uniform_np(bits)


def column_uniforms_np(key: int, columns: np.ndarray, width: int) -> np.ndarray:
    """One row's uniforms at `columns` (< `width`) only: what `uniforms_np` gives there."""
    return _bits_to_uniform_np(_fmix32_u32(np.uint32(key) ^ _column_hashes_np(width)[columns]))


@functools.cache
def _column_hashes_np(width: int) -> np.ndarray:
    """[width] uint32 hashes of the column indices (one table per row width, built once)."""
    return fmix32(_mul32(np.arange(width, dtype=np.int64), _GOLDEN)).astype(np.uint32)


@functools.cache
def _column_hashes(width: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_column_hashes_np(width).astype(np.int64)).to(device)


def uniforms(keys: torch.Tensor, width: int) -> torch.Tensor:
    """The torch twin of `uniforms_np`, on `keys`' device: [R, width] float32, bit-identical."""
    bits = fmix32(keys.long().unsqueeze(1) ^ _column_hashes(width, keys.device).unsqueeze(0))
    return ((bits >> 9) * 2 + 1).float() * 2.0**-24


def uniform_at(seed: int, counter: int, column: int) -> float:
    """One uniform (host, Python ints): what `uniforms` gives at that row key and column."""
    bits = fmix32(row_key(seed, counter) ^ fmix32(_mul32(column, _GOLDEN)))
    return float(np.float32((bits >> 9) * 2 + 1) * np.float32(2.0**-24))

"""KV migration: a decoding stream's rows of the slot KV cache, copied out of one engine and into
another, so it continues there without prefilling again.

`LLMEngine.export_kv` takes a `KVSnapshot` of a decoding request (and its CFG twin); the
LLMStage hands it on with the stream's `ResumeState` (`deployments.kv_courier`: over the stage
transport, or through Ray's object store), and the engine
that resumes the stream writes it into fresh slots (`LLMEngine.add_prompt` with a snapshot)
instead of prefilling. The rows hold every known position but the last sampled token, which the
next decode step writes, as on the engine that exported them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_stage.kv_cache import KVCache
from llm_stage.request import Request


@dataclass(frozen=True)
class KVSnapshot:
    """Per unit row (the request, then its CFG twin): keys and values [layers, kv_heads, n, head_dim]."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def num_positions(self) -> tuple[int, ...]:
        return tuple(k.shape[2] for k in self.keys)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def as_tensors(self) -> dict[str, torch.Tensor]:
        """Named tensors, the form the stage transport sends: keys.0, values.0, keys.1 (its twin) ..."""
        named = {f"keys.{i}": k for i, k in enumerate(self.keys)}
        return named | {f"values.{i}": v for i, v in enumerate(self.values)}

    @classmethod
    def from_tensors(cls, named: dict[str, torch.Tensor]) -> KVSnapshot:
        rows = range(sum(name.startswith("keys.") for name in named))
        return cls(tuple(named[f"keys.{i}"] for i in rows), tuple(named[f"values.{i}"] for i in rows))


def take_rows(cache: KVCache, unit: list[Request]) -> KVSnapshot:
    """Copies of the unit's cached positions (each row's `num_cached`), on the CPU. The snapshot is
    the same whichever layout either engine's cache has (a slot row or a row's blocks, in order)."""
    rows = [cache.take_row(row.slot, row.num_cached) for row in unit]
    return KVSnapshot(tuple(k for k, _ in rows), tuple(v for _, v in rows))


def put_rows(cache: KVCache, unit: list[Request], snapshot: KVSnapshot) -> None:
    """Write the snapshot into the unit's (freshly allocated) slots and mark those positions cached."""
    for row, keys, values in zip(unit, snapshot.keys, snapshot.values, strict=True):
        cache.put_row(row.slot, keys, values)
        row.num_cached = keys.shape[2]


def fits(snapshot: KVSnapshot, unit: list[Request], cache: KVCache) -> bool:
    """Whether the snapshot matches the unit: one row each, every row's known tokens but the last."""
    layout = (cache.keys.shape[0], cache.keys.shape[2], cache.keys.shape[4])  # layers, kv_heads, head_dim
    if len(snapshot.keys) != len(unit) or any((k.shape[0], k.shape[1], k.shape[3]) != layout for k in snapshot.keys):
        return False
    return all(n == row.num_known - 1 for n, row in zip(snapshot.num_positions, unit, strict=True))

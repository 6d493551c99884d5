"""Writes a state dict as a hub checkpoint does: `model-0000k-of-0000n.safetensors` shards of about
`shard_bytes` and `model.safetensors.index.json`. Used by the published-layout writers of tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_sharded(directory: Path, state: dict[str, torch.Tensor], shard_bytes: int) -> None:
    """`state` (kept as it is, e.g. float32) in shards of about `shard_bytes`, and the index naming each key's."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        if size > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor.contiguous().clone()
        size += tensor.numel() * tensor.element_size()
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))

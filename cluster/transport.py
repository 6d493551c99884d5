"""Stage-to-stage tensor transport (voice conditioning, prompt KV) between engine actors.

Each stage replica owns a synchronous `TensorEndpoint` actor; a `TensorChannel` moves a named
tensor from the LLM-stage endpoint to the detok-stage endpoint with Ray Direct Transport
(`gloo` on CPU, `nccl` on GPU: a collective group created by the channel's coordinator, which
submits both tasks, as RDT requires) or through the object store, chosen by TransportConfig.
"""

from __future__ import annotations

import ray
import torch

from cluster.config import TransportConfig


@ray.remote(max_concurrency=4)  # RDT hung here with the default concurrency of 1
class TensorEndpoint:
    """Holds named tensors for one stage replica."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def put(self, key: str, tensor: torch.Tensor) -> None:
        self._tensors[key] = tensor

    def take(self, key: str) -> torch.Tensor:
        return self._tensors.pop(key)

    def keys(self) -> list[str]:
        return sorted(self._tensors)

    @ray.method(tensor_transport="gloo")
    def export_gloo(self, key: str) -> torch.Tensor:
        return self._tensors.pop(key)

    @ray.method(tensor_transport="nccl")
    def export_nccl(self, key: str) -> torch.Tensor:
        return self._tensors.pop(key)

    def import_tensor(self, tensor: torch.Tensor, key: str) -> dict:
        """Store a tensor that arrived as a (direct-transport) argument; report what arrived."""
        self._tensors[key] = tensor
        return {"key": key, "shape": list(tensor.shape), "device": str(tensor.device), "sum": float(tensor.sum())}


@ray.remote
class _Coordinator:
    """Creates the collective group and submits both halves of every transfer (RDT's rule)."""

    def __init__(self, producer, consumer, backend: str) -> None:
        from ray.experimental.collective import create_collective_group

        self.producer, self.consumer, self.backend = producer, consumer, backend
        create_collective_group([producer, consumer], backend=backend)

    def move(self, key: str) -> dict:
        export = self.producer.export_gloo if self.backend == "gloo" else self.producer.export_nccl
        ref = export.remote(key)
        return ray.get(self.consumer.import_tensor.remote(ref, key))


class TensorChannel:
    """producer endpoint -> consumer endpoint, by the configured transport."""

    def __init__(self, producer, consumer, config: TransportConfig) -> None:
        self.producer, self.consumer, self.kind = producer, consumer, config.tensor_transport
        self._coordinator = None
        if self.kind != "object_store":
            self._coordinator = _Coordinator.remote(producer, consumer, self.kind)

    def move(self, key: str) -> dict:
        """Move the producer's tensor `key` to the consumer; returns the consumer's receipt."""
        if self._coordinator is not None:
            return ray.get(self._coordinator.move.remote(key))
        tensor_ref = self.producer.take.remote(key)
        return ray.get(self.consumer.import_tensor.remote(tensor_ref, key))

"""Stage-to-stage tensors (KV, conditioning): Ray Direct Transport or the object store.

Each stage replica owns a `TensorEndpoint`, a plain synchronous actor that holds that replica's
tensors by key (RDT's two-sided transports need synchronous actors; Serve replicas are asyncio
actors, so the tensors live beside them, not in them). A `TensorTransport` joins endpoints in
one collective group and moves a tensor between two of them: with `gloo` (CPU) or `nccl` (GPU)
the tensor goes point to point over the group, outside the object store; with `object_store`
it is serialized through Ray's object store (the fallback wherever RDT cannot run). RDT
requires the process that created the group to submit every transfer, so one TensorTransport
drives all moves of its group. Each endpoint counts what it sent and received.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum

import ray
import torch
from ray.exceptions import RayError

Tensors = torch.Tensor | dict[str, torch.Tensor]
ENDPOINT_CONCURRENCY = 4  # RDT transfers hang on endpoints that run one call at a time
# A transfer whose reader gave up may land later: an endpoint refuses its tensors this long after
# the discard (longer than any transfer waits: `TensorTransport.move` gives up after 60 s).
DISCARD_REMEMBERED_S = 600.0


class TransportKind(str, Enum):
    OBJECT_STORE = "object_store"
    GLOO = "gloo"  # RDT over torch.distributed gloo: CPU tensors
    NCCL = "nccl"  # RDT over NCCL: CUDA tensors

    @property
    def group_backend(self) -> str | None:
        return {TransportKind.GLOO: "torch_gloo", TransportKind.NCCL: "nccl"}.get(self)


def num_bytes(tensors: Tensors) -> int:
    parts = tensors.values() if isinstance(tensors, dict) else [tensors]
    return sum(t.numel() * t.element_size() for t in parts)


@ray.remote(num_cpus=0)  # it holds and forwards tensors; the replica beside it owns the compute
class TensorEndpoint:
    """One replica's tensors by key, and its transfer counters. A key discarded before its tensors
    came (their reader gave up on a transfer still under way) is refused when they arrive."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.tensors: dict[str, Tensors] = {}
        self.discarded: dict[str, float] = {}  # key -> when: its tensors are dropped as they arrive
        self.lock = threading.Lock()  # (a threaded actor: a receive and a discard of one key may race)
        self.counters = {"sent": 0, "received": 0, "bytes_sent": 0, "bytes_received": 0, "discarded": 0}

    def hold(self, key: str, tensors: Tensors) -> int:
        with self.lock:
            self.tensors[key] = tensors
        return num_bytes(tensors)

    def get(self, key: str) -> Tensors:
        return self.tensors[key]

    def take(self, key: str) -> Tensors:
        """The tensors under `key`, no longer held here."""
        with self.lock:
            return self.tensors.pop(key)

    def drop(self, key: str) -> bool:
        with self.lock:
            return self.tensors.pop(key, None) is not None

    def discard(self, key: str) -> bool:
        """Nobody will read `key`: drop its tensors now (True), or as they arrive (remembered
        DISCARD_REMEMBERED_S)."""
        now = time.monotonic()
        with self.lock:
            self.discarded = {old: at for old, at in self.discarded.items() if at > now - DISCARD_REMEMBERED_S}
            if self.tensors.pop(key, None) is not None:
                self.counters["discarded"] += 1
                return True
            self.discarded[key] = now
            return False

    def _send(self, key: str) -> Tensors:
        tensors = self.tensors[key]
        self.counters["sent"] += 1
        self.counters["bytes_sent"] += num_bytes(tensors)
        return tensors

    @ray.method(tensor_transport="gloo")
    def send_gloo(self, key: str) -> Tensors:
        return self._send(key)

    @ray.method(tensor_transport="nccl")
    def send_nccl(self, key: str) -> Tensors:
        return self._send(key)

    def send_object_store(self, key: str) -> Tensors:
        return self._send(key)

    def receive(self, key: str, tensors: Tensors) -> int:
        with self.lock:
            self.counters["received"] += 1
            self.counters["bytes_received"] += num_bytes(tensors)
            if self.discarded.pop(key, None) is None:
                self.tensors[key] = tensors
            else:
                self.counters["discarded"] += 1
        return num_bytes(tensors)

    def stats(self) -> dict:
        with self.lock:
            held = list(self.tensors.values())
            counters = dict(self.counters)
        return {"name": self.name, "held": len(held), "bytes_held": sum(map(num_bytes, held)), **counters}


@dataclass(frozen=True)
class Transfer:
    key: str
    num_bytes: int
    seconds: float


class TensorTransport:
    """Moves tensors between the endpoints of one group (create it in the process that will
    submit the transfers: RDT refuses transfers submitted from anywhere else)."""

    def __init__(self, endpoints: list, kind: TransportKind | str = TransportKind.OBJECT_STORE) -> None:
        self.kind = TransportKind(kind)
        self.endpoints = list(endpoints)
        if self.kind.group_backend is not None:
            from ray.experimental.collective import create_collective_group

            create_collective_group(self.endpoints, backend=self.kind.group_backend)

    def move(self, key: str, src, dst, timeout_s: float = 60.0) -> Transfer:
        """`src`'s tensors under `key` now also live in `dst` under `key`."""
        start = time.perf_counter()
        sent = getattr(src, f"send_{self.kind.value}").remote(key)
        received = ray.get(dst.receive.remote(key, sent), timeout=timeout_s)  # the ref must be a direct argument
        return Transfer(key, received, time.perf_counter() - start)

    def close(self) -> None:
        if self.kind.group_backend is not None:
            from ray.experimental.collective import destroy_collective_group, get_collective_groups

            for group in get_collective_groups(self.endpoints):
                destroy_collective_group(group)


def new_endpoint(name: str, node_id: str | None = None):
    """A TensorEndpoint, on `node_id` when given (soft: anywhere if that node is gone)."""
    options: dict = {"max_concurrency": ENDPOINT_CONCURRENCY}
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True)
    return TensorEndpoint.options(**options).remote(name)


@dataclass
class EndpointPair:
    """A source and a sink endpoint in a two-member group of their own (torch gloo gives a process
    one group for life), driven by the process that made it: it submits every send."""

    source: object
    sink: object
    transport: TensorTransport
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, source, sink, kind: TransportKind) -> EndpointPair:
        ray.get([source.stats.remote(), sink.stats.remote()])  # both started: the first send never waits for them
        return cls(source, sink, TensorTransport([source, sink], kind))

    def send(self, key: str, tensors) -> Transfer:
        """`tensors` (or an ObjectRef of them, read where the source runs) land in the sink under `key`."""
        with self.lock:
            ray.get(self.source.hold.remote(key, tensors))
            try:
                return self.transport.move(key, self.source, self.sink)
            except RayError:  # (the move timed out, or an endpoint died): a receive under way lands for nobody
                self.sink.discard.remote(key)
                raise
            finally:
                ray.get(self.source.drop.remote(key))

    def close(self, timeout_s: float) -> dict[str, int]:
        """Tear the group down and stop the source; its (sent, bytes_sent), zeros if the pair broke."""
        counters = {"sent": 0, "bytes_sent": 0}
        try:
            sent = ray.get(self.source.stats.remote(), timeout=timeout_s)
            counters = {key: sent[key] for key in counters}
            self.transport.close()
        except Exception:  # the sink's side of the group is gone with its replica
            pass
        ray.kill(self.source)
        return counters

"""Moved streams' KV over the stage transport: the LLM stage's KV courier, and each replica's side.

A stream that leaves its LLM replica (drain, move-out, rebalance) takes its KV rows along. The
sender does not know yet which replica the router will pick, so it puts the rows in its node's
object store as a `KVParcel` and keeps them a while. A receiver on the same node reads them from
there (shared memory: any copy is slower, BENCHMARKS.md); one on another node asks the courier to
deliver the parcel to its own node (`migration.kv_transport: gloo` sends every move that way).
The courier, a Serve deployment actor of the LLM stage (made and stopped with the stage,
recreated by Serve if it dies), keeps an `EndpointPair` per (sender node, receiver node): the
source endpoint reads the parcel on the sender's node, RDT moves it point to point over gloo to
the sink endpoint on the receiver's node, and the receiver reads it there. RDT needs the process
that formed a group to submit its transfers, so the courier is a synchronous threaded actor.
With `migration.kv_transport: object_store`, without a courier (a stage that never runs two
replicas), or when a delivery fails, the receiver reads the parcel from the object store too
(Ray pulls it across nodes): a move never prefills for the transport's sake.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayError

from core.config import ServeConfig, StageDeploymentConfig
from core.messages import KVParcel
from deployments.transport import EndpointPair, TransportKind, new_endpoint
from llm_stage.migration import KVSnapshot

COURIER_NAME = "kv_courier"
COURIER_CONCURRENCY = 8  # deliveries (and pair formations) at once; Serve's health checks need a thread too
PING_TIMEOUT_S = 5.0
# A parcel's rows are owned by its sender: it holds a reference this long, so they are not freed
# before the replica continuing the stream has read them (the router only borrows the ref).
KEEP_SENT_S = 60.0
# A delivery whose receiver gave up before it started is skipped when it starts within this long
# (one that started already has its rows dropped by the sink as they land, `TensorEndpoint.discard`).
ABANDONED_KEPT_S = 600.0
NodePair = tuple[str, str]  # (sender node id, receiver node id)


class DeliveryAbandoned(RuntimeError):
    """The receiver stopped waiting for this parcel before its delivery started: it was skipped."""


@dataclass(frozen=True)
class Delivered:
    """A parcel's rows are in `sink` (an endpoint on the receiver's node) under the parcel's key."""

    sink: object
    num_bytes: int
    seconds: float


class KVCourier:
    """Delivers parcels between nodes over RDT (one two-endpoint group per node pair, formed on the
    first delivery or when a replica prepares it at start)."""

    def __init__(self, kind: str = "gloo") -> None:
        self.kind = TransportKind(kind)
        self.pairs: dict[NodePair, EndpointPair] = {}
        self.forming: dict[NodePair, threading.Lock] = {}
        self.abandoned: dict[str, float] = {}  # key -> when its receiver gave up
        self.lock = threading.Lock()  # pairs, forming, abandoned, counters
        self.num_delivered = self.bytes_delivered = self.num_pairs_formed = self.num_failed = 0
        self.num_abandoned = self.num_skipped = 0
        self.seconds = 0.0

    def prepare(self, sender_node: str, receiver_node: str) -> None:
        """Form the pair now, so the first move between these nodes does not wait for it."""
        self._pair((sender_node, receiver_node))

    def deliver(self, parcel_ref: list, key: str, sender_node: str, receiver_node: str) -> Delivered:
        """Move the rows of `parcel_ref[0]` (a ref in a list: read by the source endpoint, not here)."""
        nodes = (sender_node, receiver_node)
        pair = self._pair(nodes)
        with self.lock:
            if self.abandoned.pop(key, None) is not None:  # (past this, `abandon` finds the pair: its sink discards)
                self.num_skipped += 1
                raise DeliveryAbandoned(key)
        try:
            transfer = pair.send(key, parcel_ref[0])
        except RayError:
            with self.lock:
                self.num_failed += 1
            if not _is_alive(pair):  # an endpoint died (its node went away): the next delivery forms a new pair
                with self.lock:
                    if self.pairs.get(nodes) is pair:
                        del self.pairs[nodes]
                pair.close(PING_TIMEOUT_S)
            raise  # (both alive: the parcel was lost with its sender; the pair stays)
        with self.lock:
            self.num_delivered += 1
            self.bytes_delivered += transfer.num_bytes
            self.seconds += transfer.seconds
        return Delivered(pair.sink, transfer.num_bytes, transfer.seconds)

    def abandon(self, key: str, sender_node: str, receiver_node: str) -> None:
        """The receiver stopped waiting for `key` (it reads the object store instead): its rows leave
        the sink now or as they land, and a delivery not started yet is skipped."""
        now = time.monotonic()
        with self.lock:
            self.abandoned = {old: at for old, at in self.abandoned.items() if at > now - ABANDONED_KEPT_S}
            self.abandoned[key] = now
            self.num_abandoned += 1
            pair = self.pairs.get((sender_node, receiver_node))
        if pair is not None:
            pair.sink.discard.remote(key)

    def _pair(self, nodes: NodePair) -> EndpointPair:
        with self.lock:
            pair = self.pairs.get(nodes)
            forming = self.forming.setdefault(nodes, threading.Lock())
        if pair is not None:
            return pair
        with forming:  # one formation per node pair; deliveries between other nodes go on meanwhile
            with self.lock:
                pair = self.pairs.get(nodes)
            if pair is None:
                sender, receiver = nodes
                source = new_endpoint(f"kv-courier:{sender[:8]}>{receiver[:8]}", sender)
                sink = new_endpoint(f"kv-courier:{receiver[:8]}<{sender[:8]}", receiver)
                pair = EndpointPair.open(source, sink, self.kind)
                with self.lock:
                    self.pairs[nodes] = pair
                    self.num_pairs_formed += 1
        return pair

    def stats(self) -> dict:
        """Counters, and the sinks' own (what crossed the transport, as the endpoints counted it, and
        the rows they hold now: delivered, not read yet), and the rows the sources hold now (a send
        under way)."""
        with self.lock:
            pairs = dict(self.pairs)
            counters = {
                "transport": self.kind.value, "delivered": self.num_delivered, "bytes_delivered": self.bytes_delivered,
                "seconds": self.seconds, "pairs_formed": self.num_pairs_formed, "failed": self.num_failed,
                "abandoned": self.num_abandoned, "skipped": self.num_skipped,
            }  # fmt: skip
        sinks = ray.get([pair.sink.stats.remote() for pair in pairs.values()], timeout=PING_TIMEOUT_S)
        sources = ray.get([pair.source.stats.remote() for pair in pairs.values()], timeout=PING_TIMEOUT_S)
        return counters | {
            "sinks": _summed(sinks, ("received", "bytes_received", "discarded", "held", "bytes_held")),
            "sources": _summed(sources, ("held", "bytes_held")),
        }


def _summed(endpoints: list[dict], keys: tuple[str, ...]) -> dict[str, int]:
    return {key: sum(endpoint[key] for endpoint in endpoints) for key in keys}


def _is_alive(pair: EndpointPair) -> bool:
    try:
        ray.get([pair.source.stats.remote(), pair.sink.stats.remote()], timeout=PING_TIMEOUT_S)
        return True
    except RayError:
        return False


KVCourierActor = ray.remote(KVCourier)  # (Serve's deployment actors take a Ray actor class)


def may_run_several(stage: StageDeploymentConfig) -> bool:
    return stage.max_replicas > 1 if stage.autoscaling else stage.num_replicas > 1


def has_courier(config: ServeConfig) -> bool:
    """Whether the LLM stage runs a KV courier: KV may move over gloo, between replicas it may run."""
    return config.migration.kv_transport != TransportKind.OBJECT_STORE.value and may_run_several(config.llm)


def courier_actors(config: ServeConfig) -> list:
    """The LLM stage's deployment actors: the KV courier where it has one (`has_courier`)."""
    if not has_courier(config):
        return []
    from ray.serve.config import DeploymentActorConfig

    return [
        DeploymentActorConfig(
            name=COURIER_NAME, actor_class=KVCourierActor, init_kwargs={"kind": TransportKind.GLOO.value},
            actor_options={"num_cpus": 0, "max_concurrency": COURIER_CONCURRENCY},
        )
    ]  # fmt: skip


class KVMoves:
    """An LLM replica's side of moves: parcels out (kept until read), rows in (over the courier, or
    from the object store), and what came which way."""

    def __init__(self, config: ServeConfig, replica: str) -> None:
        self.use_courier = has_courier(config)
        self.courier_within_node = config.migration.kv_transport == TransportKind.GLOO.value  # (auto: between nodes)
        self.app_name = config.app_name
        self.timeout_s = config.migration.delivery_timeout_s
        self.replica = replica
        self.node_id = ray.get_runtime_context().get_node_id()
        self.sent: list[tuple[float, object]] = []  # (when, ObjectRef) of parcels handed off
        self.num_sent = 0
        self.num_in = {TransportKind.GLOO.value: 0, TransportKind.OBJECT_STORE.value: 0}
        self.bytes_in = self.num_fallbacks = self.num_lost = 0
        self.courier = None

    def warm_up(self) -> None:
        """(at start, off the event loop) Form the pairs into this node from the other LLM replicas'
        nodes (and this node's own, under `gloo`), so a move here never waits for one."""
        courier = self._courier() if self.use_courier else None
        if courier is None:
            return
        from router.drain import llm_nodes

        senders = {node for node in llm_nodes(self.app_name) if node != self.node_id}
        if self.courier_within_node:
            senders.add(self.node_id)
        ray.get([courier.prepare.remote(node, self.node_id) for node in senders], timeout=self.timeout_s)

    def parcel(self, req_id: str, kv: KVSnapshot) -> KVParcel:
        """Put a leaving stream's rows in the object store (this replica owns them: kept a while)."""
        kept_since_s = time.monotonic() - KEEP_SENT_S
        self.sent = [(at, ref) for at, ref in self.sent if at > kept_since_s]
        ref = ray.put(kv.as_tensors())
        self.sent.append((time.monotonic(), ref))
        self.num_sent += 1
        return KVParcel(ref, f"{req_id}@{self.replica}#{self.num_sent}", self.node_id, kv.num_bytes)

    async def receive(self, parcel: KVParcel) -> KVSnapshot | None:
        """The parcel's rows (None: lost with the replica that sent them: the stream prefills)."""
        named = await self._over_courier(parcel)
        way = TransportKind.GLOO.value
        if named is None:
            way = TransportKind.OBJECT_STORE.value
            try:
                named = await parcel.ref
            except RayError:
                self.num_lost += 1
                return None
        kv = KVSnapshot.from_tensors(named)
        self.num_in[way] += 1
        self.bytes_in += kv.num_bytes
        return kv

    async def _over_courier(self, parcel: KVParcel) -> dict | None:
        between_nodes = parcel.node_id != self.node_id
        courier = self._courier() if self.use_courier and (between_nodes or self.courier_within_node) else None
        if courier is None:
            return None
        try:
            call = courier.deliver.remote([parcel.ref], parcel.key, parcel.node_id, self.node_id)
            delivered: Delivered = await asyncio.wait_for(call, self.timeout_s)
            return await delivered.sink.take.remote(parcel.key)  # the rows are here now, and gone from the sink
        except (RayError, TimeoutError):
            self.num_fallbacks += 1
            self.courier = None  # ask Serve for it again: it may have been recreated
            courier.abandon.remote(parcel.key, parcel.node_id, self.node_id)  # what it still delivers is dropped
            return None
        except asyncio.CancelledError:  # (the stream ended while its rows were on the way)
            courier.abandon.remote(parcel.key, parcel.node_id, self.node_id)
            raise

    def _courier(self):
        if self.courier is None:
            from ray import serve

            try:
                self.courier = serve.get_deployment_actor(COURIER_NAME)
            except Exception:  # no courier for this stage (one replica), or Serve is recreating it
                return None
        return self.courier

    def stats(self) -> dict:
        return {
            "kv_moved_in_over": dict(self.num_in), "kv_bytes_moved_in": self.bytes_in,
            "kv_moved_out": self.num_sent,  # parcels of streams handed off (moved out or rebalanced)
            "kv_courier_fallbacks": self.num_fallbacks, "kv_lost": self.num_lost,
        }  # fmt: skip

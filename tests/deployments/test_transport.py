"""Tensors between stage endpoints over a real local Ray: RDT over gloo and the object store."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
import torch

from deployments.transport import TensorEndpoint, TensorTransport, TransportKind, num_bytes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def kv_of(positions: int) -> dict[str, torch.Tensor]:
    """The CPU preset's KV layout for one request: [layers, kv_heads, positions, head_dim] each."""
    return {"keys": torch.randn(2, 2, positions, 64), "values": torch.randn(2, 2, positions, 64)}


@pytest.mark.parametrize("kind", [TransportKind.GLOO, TransportKind.OBJECT_STORE])
def test_kv_crosses_from_one_stage_endpoint_to_another(local_ray, kind):
    llm, detok = TensorEndpoint.remote("llm"), TensorEndpoint.remote("detok")
    transport = TensorTransport([llm, detok], kind)
    try:
        kv = kv_of(64)
        ray.get(llm.hold.remote("req-1/kv", kv))
        transfer = transport.move("req-1/kv", llm, detok)
        got = ray.get(detok.get.remote("req-1/kv"))
        assert torch.equal(got["keys"], kv["keys"]) and torch.equal(got["values"], kv["values"])
        sent, received = ray.get(llm.stats.remote()), ray.get(detok.stats.remote())
        assert sent["sent"] == received["received"] == 1
        assert sent["bytes_sent"] == received["bytes_received"] == transfer.num_bytes == num_bytes(kv)
    finally:
        transport.close()
        for endpoint in (llm, detok):
            ray.kill(endpoint)


def test_gloo_refs_stay_out_of_the_object_store(local_ray):
    """An RDT ref cannot be read back through the object store by a process outside the group:
    the proof that the gloo path moved the tensor point to point."""
    llm, detok = TensorEndpoint.remote("llm"), TensorEndpoint.remote("detok")
    transport = TensorTransport([llm, detok], TransportKind.GLOO)
    try:
        ray.get(llm.hold.remote("cond", torch.randn(192)))
        rdt_ref = llm.send_gloo.remote("cond")
        plain_ref = llm.send_object_store.remote("cond")
        assert ray.get(plain_ref).shape == (192,)
        with pytest.raises(Exception, match="(?i)rdt|two-sided|not allowed"):
            ray.get(rdt_ref, timeout=30)
        ray.get(detok.receive.remote("cond", rdt_ref), timeout=30)  # the group's receiver gets it
        assert ray.get(detok.stats.remote())["received"] == 1
    finally:
        transport.close()
        for endpoint in (llm, detok):
            ray.kill(endpoint)


def test_the_kv_courier_delivers_a_parcel_over_gloo_between_nodes_endpoints(local_ray):
    """A moved stream's KV (with a CFG twin's rows) put by its sender, delivered by a real
    KVCourier over an RDT-gloo pair of its own, taken from the sink: the same tensors, counted by
    the sink endpoint as received over the group, none left there. A second delivery reuses the pair."""
    from deployments.kv_courier import COURIER_CONCURRENCY, KVCourierActor
    from llm_stage.migration import KVSnapshot

    courier = KVCourierActor.options(max_concurrency=COURIER_CONCURRENCY).remote("gloo")
    node = ray.get_runtime_context().get_node_id()
    try:
        for n, positions in enumerate((64, 9)):
            kv = KVSnapshot(tuple(torch.randn(2, 2, positions, 64) for _ in range(2)),
                            tuple(torch.randn(2, 2, positions, 64) for _ in range(2)))  # fmt: skip
            ref = ray.put(kv.as_tensors())  # the sender's node's object store (here: the driver's)
            delivered = ray.get(courier.deliver.remote([ref], f"req-{n}@LLMStage#a#1", node, node), timeout=120)
            got = KVSnapshot.from_tensors(ray.get(delivered.sink.take.remote(f"req-{n}@LLMStage#a#1")))
            assert all(torch.equal(a, b) for a, b in zip((*got.keys, *got.values), (*kv.keys, *kv.values), strict=True))
            assert delivered.num_bytes == kv.num_bytes and got.num_positions == (positions, positions)
        stats = ray.get(courier.stats.remote())
        assert stats["pairs_formed"] == 1 and stats["delivered"] == 2 and stats["transport"] == "gloo"
        assert stats["sinks"] == {"received": 2, "bytes_received": stats["bytes_delivered"], "discarded": 0, "held": 0,
                                  "bytes_held": 0}  # fmt: skip
    finally:
        ray.kill(courier)


@ray.remote(num_cpus=0)
class _Sender:
    """An LLM replica handing a stream off: it owns the parcel it puts."""

    def parcel(self, named: dict) -> list:
        self.ref = ray.put(named)
        return [self.ref]


def test_a_parcel_lost_with_its_sender_fails_its_delivery_and_keeps_the_pair(local_ray):
    """The sender died before the receiver asked (its parcel died with it): that delivery fails (the
    receiver then prefills), but the node pair is healthy and carries the next parcel as it was."""
    from deployments.kv_courier import COURIER_CONCURRENCY, KVCourierActor

    courier = KVCourierActor.options(max_concurrency=COURIER_CONCURRENCY).remote("gloo")
    node = ray.get_runtime_context().get_node_id()
    sender = _Sender.remote()
    try:
        lost = ray.get(sender.parcel.remote(kv_of(8)))
        ray.kill(sender)
        with pytest.raises(ray.exceptions.RayError):
            ray.get(courier.deliver.remote(lost, "lost@a#1", node, node), timeout=120)
        delivered = ray.get(courier.deliver.remote([ray.put(kv_of(8))], "kept@a#2", node, node), timeout=120)
        assert delivered.num_bytes == num_bytes(kv_of(8))
        stats = ray.get(courier.stats.remote())
        assert (stats["failed"], stats["delivered"], stats["pairs_formed"]) == (1, 1, 1), stats
    finally:
        ray.kill(courier)


def _once_settled(courier, num_abandoned: int, timeout_s: float = 20.0) -> dict:
    """The courier's counters once `num_abandoned` deliveries were given up on, each was skipped
    or had its rows dropped by the sink, and every delivery that went ahead has returned (its
    counter and its source's drop come after the rows land) (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(courier.stats.remote())
        settled = stats["abandoned"] >= num_abandoned <= stats["skipped"] + stats["sinks"]["discarded"]
        returned = stats["delivered"] + stats["skipped"] + stats["failed"] >= num_abandoned
        at_rest = stats["sinks"]["held"] == stats["sources"]["held"] == 0
        if (settled and returned and at_rest) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _gloo_pair_courier(node: str):
    from deployments.kv_courier import COURIER_CONCURRENCY, KVCourierActor

    courier = KVCourierActor.options(max_concurrency=COURIER_CONCURRENCY).remote("gloo")
    ray.get(courier.prepare.remote(node, node), timeout=120)  # the pair first: a delivery starts at once
    return courier


def test_a_delivery_the_receiver_gave_up_on_leaves_no_rows_in_the_sink(local_ray):
    """The receiver's wait for the courier times out (here: always), so it reads the object store
    instead and tells the courier; whatever the courier had delivered, or delivers after that, is
    dropped from the sink, not held there for ever (and the source keeps nothing either)."""
    from core.config import MigrationConfig, ServeConfig, StageDeploymentConfig
    from deployments.kv_courier import KVMoves
    from llm_stage.migration import KVSnapshot

    config = ServeConfig(
        llm=StageDeploymentConfig(num_replicas=2),
        migration=MigrationConfig(kv_transport="gloo", delivery_timeout_s=0.001),  # shorter than any delivery
    )
    courier = _gloo_pair_courier(ray.get_runtime_context().get_node_id())
    try:
        sender, receiver = KVMoves(config, "LLMStage#a"), KVMoves(config, "LLMStage#b")
        receiver.courier = courier  # (the Serve deployment actor, in a cluster)
        for n in range(3):
            kv = KVSnapshot((torch.randn(2, 2, 32, 64),), (torch.randn(2, 2, 32, 64),))
            got = asyncio.run(receiver.receive(sender.parcel(f"req-{n}", kv)))
            assert got is not None and torch.equal(got.keys[0], kv.keys[0]) and torch.equal(got.values[0], kv.values[0])
            receiver.courier = courier
        assert receiver.stats()["kv_moved_in_over"] == {"gloo": 0, "object_store": 3}
        assert receiver.stats()["kv_courier_fallbacks"] == 3
        stats = _once_settled(courier, num_abandoned=3)
        assert stats["abandoned"] == 3 and stats["skipped"] + stats["sinks"]["discarded"] == 3, stats
        assert stats["sinks"]["received"] == stats["sinks"]["discarded"] == stats["delivered"], stats
        assert stats["sinks"]["held"] == stats["sinks"]["bytes_held"] == 0, stats
        assert stats["sources"] == {"held": 0, "bytes_held": 0}, stats
    finally:
        ray.kill(courier)


def test_rows_abandoned_after_they_landed_leave_the_sink_at_once(local_ray):
    node = ray.get_runtime_context().get_node_id()
    courier = _gloo_pair_courier(node)
    try:
        ray.get(courier.deliver.remote([ray.put(kv_of(8))], "late-reader@a#1", node, node), timeout=60)
        assert ray.get(courier.stats.remote())["sinks"]["held"] == 1
        ray.get(courier.abandon.remote("late-reader@a#1", node, node), timeout=60)
        stats = _once_settled(courier, num_abandoned=1)
        assert (stats["sinks"]["discarded"], stats["sinks"]["held"], stats["skipped"]) == (1, 0, 0), stats
    finally:
        ray.kill(courier)


def test_a_delivery_abandoned_before_it_started_is_skipped(local_ray):
    from deployments.kv_courier import DeliveryAbandoned

    node = ray.get_runtime_context().get_node_id()
    courier = _gloo_pair_courier(node)
    try:
        ray.get(courier.abandon.remote("gone@a#1", node, node), timeout=60)
        with pytest.raises(DeliveryAbandoned):
            ray.get(courier.deliver.remote([ray.put(kv_of(8))], "gone@a#1", node, node), timeout=60)
        stats = ray.get(courier.stats.remote())
        assert (stats["skipped"], stats["delivered"], stats["sinks"]["received"]) == (1, 0, 0), stats
        assert stats["sinks"]["held"] == stats["sources"]["held"] == 0, stats
    finally:
        ray.kill(courier)


def test_tensors_discarded_before_they_arrive_are_dropped_as_they_land(local_ray):
    """The sink's side of a late arrival: the discard comes first, the rows over gloo after it."""
    source, sink = TensorEndpoint.remote("source"), TensorEndpoint.remote("sink")
    transport = TensorTransport([source, sink], TransportKind.GLOO)
    try:
        ray.get(source.hold.remote("late@a#1", kv_of(8)))
        assert ray.get(sink.discard.remote("late@a#1")) is False  # nothing there yet: remembered
        transport.move("late@a#1", source, sink)
        transport.move("late@a#1", source, sink)  # (a key is discarded once: the same key again is kept)
        stats = ray.get(sink.stats.remote())
        assert (stats["received"], stats["discarded"], stats["held"]) == (2, 1, 1), stats
        assert ray.get(sink.discard.remote("late@a#1")) is True and ray.get(sink.stats.remote())["held"] == 0
    finally:
        transport.close()
        for endpoint in (source, sink):
            ray.kill(endpoint)

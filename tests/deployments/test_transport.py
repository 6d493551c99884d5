"""Tensors between stage endpoints over a real local Ray: RDT over gloo and the object store."""

from __future__ import annotations

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
    KVCourier over an RDT-gloo pair of its own, read from the sink: the same tensors, counted by
    the sink endpoint as received over the group. A second delivery reuses the pair."""
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
            got = KVSnapshot.from_tensors(ray.get(delivered.sink.get.remote(f"req-{n}@LLMStage#a#1")))
            assert all(torch.equal(a, b) for a, b in zip((*got.keys, *got.values), (*kv.keys, *kv.values), strict=True))
            assert delivered.num_bytes == kv.num_bytes and got.num_positions == (positions, positions)
        stats = ray.get(courier.stats.remote())
        assert stats["pairs_formed"] == 1 and stats["delivered"] == 2 and stats["transport"] == "gloo"
        assert stats["sinks"] == {"received": 2, "bytes_received": stats["bytes_delivered"]}
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

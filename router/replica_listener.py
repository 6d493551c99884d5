"""Keeps a Serve replica's internal gRPC listener on loopback when its node's Ray is loopback-only.

Serve 2.60 starts an inter-deployment gRPC server in every replica on `[::]:0`, hard-coded
(`ray/serve/_private/replica.py`, right after the user constructor), so it would listen on every
interface even when the embedded Ray listens on 127.0.0.1 only. Each VoxRay deployment calls
`keep_replica_listener_on_loopback` from its constructor; on a node with a network address (k8s)
it changes nothing. tests/cluster/test_exposure.py lists the sockets to catch a Ray upgrade.
"""

from __future__ import annotations

from core.config import is_loopback

WILDCARD_HOSTS = ("[::]", "0.0.0.0", "")


def loopback_address(address: str) -> str:
    """`address` with a wildcard host replaced by 127.0.0.1 (other hosts kept)."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in WILDCARD_HOSTS else address


def keep_replica_listener_on_loopback() -> bool:
    """Bind this replica's internal gRPC server to 127.0.0.1 if the node's Ray is on loopback.

    Returns whether it applies (idempotent)."""
    import ray
    from ray.serve._private import replica

    if not is_loopback(ray.util.get_node_ip_address()):
        return False
    original = replica.add_port_to_grpc_server
    if getattr(original, "voxray_loopback", False):
        return True

    def add_port_on_loopback(server, address: str) -> int:
        return original(server, loopback_address(address))

    add_port_on_loopback.voxray_loopback = True
    replica.add_port_to_grpc_server = add_port_on_loopback
    return True

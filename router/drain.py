"""Graceful stop: a drain deadline in Ray's internal KV that every Router replica watches, and
move-out requests that one LLM replica watches (it hands its streams, KV included, to the others).

`start_drain` (called by `voxray serve` on SIGTERM, and by `voxray drain`, the k8s preStop hook)
sets the app's deadline. Each Router's `DrainWatch` sees it within `POLL_S`; the Router then
refuses new streams and, at the deadline, ends the ones still playing (UNAVAILABLE / 503 with a
retry hint, never a bare close), and publishes how many streams it still has so the caller
knows when Serve can stop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ray.experimental import internal_kv

POLL_S = 0.2
KV_NAMESPACE = "voxray"  # Ray internal KV namespace of drain, move-out and rebalance requests


def _deadline_key(app_name: str) -> bytes:
    return f"drain:{app_name}".encode()


def _count_prefix(app_name: str) -> bytes:
    return f"drain-open:{app_name}:".encode()


def start_drain(app_name: str, grace_s: float) -> float:
    """Start draining `app_name`: its Routers finish or end their streams by the returned deadline (Unix s)."""
    deadline_unix_s = time.time() + grace_s
    internal_kv._internal_kv_put(_deadline_key(app_name), str(deadline_unix_s).encode(), namespace=KV_NAMESPACE)
    return deadline_unix_s


def open_streams_by_router(app_name: str) -> dict[str, int]:
    """Streams each draining Router replica still has, as it last published them."""
    prefix = _count_prefix(app_name)
    keys = internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE)
    counts = {key: internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE) for key in keys}
    return {key[len(prefix) :].decode(): int(value) for key, value in counts.items() if value is not None}


def _move_out_key(app_name: str, replica: str) -> bytes:
    return f"move-out:{app_name}:{replica}".encode()


def request_move_out(app_name: str, replica: str) -> None:
    """Ask one LLM replica to hand its streams to the others (with their KV) and take no new ones."""
    internal_kv._internal_kv_put(_move_out_key(app_name, replica), b"1", namespace=KV_NAMESPACE)


def is_move_out_requested(app_name: str, replica: str) -> bool:
    return internal_kv._internal_kv_exists(_move_out_key(app_name, replica), namespace=KV_NAMESPACE)


def publish_moving_out(app_name: str, replica: str, num_streams: int) -> None:
    """A leaving LLM replica's streams not yet handed off."""
    key = f"move-out-open:{app_name}:{replica}".encode()
    internal_kv._internal_kv_put(key, str(num_streams).encode(), namespace=KV_NAMESPACE)


def moving_out_streams(app_name: str, replica: str) -> int | None:
    """What `publish_moving_out` last said (None: the replica has not answered the request yet)."""
    value = internal_kv._internal_kv_get(f"move-out-open:{app_name}:{replica}".encode(), namespace=KV_NAMESPACE)
    return int(value) if value is not None else None


def announce_llm_replica(app_name: str, replica: str, node_id: str) -> None:
    """An LLM replica says which node it runs on (so a node's pod can move its streams out)."""
    internal_kv._internal_kv_put(f"llm-node:{app_name}:{replica}".encode(), node_id.encode(), namespace=KV_NAMESPACE)


def llm_replicas_on_node(app_name: str, node_id: str) -> list[str]:
    """The LLM replicas of `app_name` that announced `node_id` (dead ones included: check liveness)."""
    prefix = f"llm-node:{app_name}:".encode()
    keys = internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE)
    on_node = [key for key in keys if internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE) == node_id.encode()]
    return sorted(key[len(prefix) :].decode() for key in on_node)


def llm_nodes(app_name: str) -> set[str]:
    """The nodes the LLM replicas of `app_name` announced (dead replicas' included)."""
    prefix = f"llm-node:{app_name}:".encode()
    keys = internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE)
    return {node.decode() for key in keys if (node := internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE))}


def clear_drain(app_name: str) -> None:
    """Forget the app's drain (a redeploy of it serves again)."""
    internal_kv._internal_kv_del(_deadline_key(app_name), namespace=KV_NAMESPACE)
    internal_kv._internal_kv_del(_count_prefix(app_name), del_by_prefix=True, namespace=KV_NAMESPACE)
    for prefix in ("move-out:", "move-out-open:", "rebalance:", "rebalance-claim:"):
        internal_kv._internal_kv_del(f"{prefix}{app_name}:".encode(), del_by_prefix=True, namespace=KV_NAMESPACE)


class DrainWatch:
    """One Router replica's view of the drain: a daemon thread polls the deadline and, once
    draining, publishes `open_streams()` for this replica."""

    def __init__(self, app_name: str, replica: str, open_streams: Callable[[], int]) -> None:
        self.app_name, self.replica = app_name, replica
        self.open_streams = open_streams
        self.deadline_unix_s: float | None = None
        self._thread = threading.Thread(target=self._watch, name="voxray-drain-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_draining(self) -> bool:
        return self.deadline_unix_s is not None

    @property
    def is_past_deadline(self) -> bool:
        return self.deadline_unix_s is not None and time.time() >= self.deadline_unix_s

    def _watch(self) -> None:
        key = _deadline_key(self.app_name)
        count_key = _count_prefix(self.app_name) + self.replica.encode()
        while True:
            try:
                value = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
                self.deadline_unix_s = float(value) if value is not None else None
                if self.deadline_unix_s is not None:
                    count = str(self.open_streams()).encode()
                    internal_kv._internal_kv_put(count_key, count, namespace=KV_NAMESPACE)
            except Exception:  # the GCS is going away with the cluster: keep the last state
                pass
            time.sleep(POLL_S)

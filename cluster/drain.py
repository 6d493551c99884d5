"""Graceful stop, driver side: drain an app, then (embedded Ray) stop Serve and Ray; or move one
node's LLM streams (with their KV) to the other replicas before its pod stops.

`voxray serve` drains on SIGTERM / SIGINT; `voxray drain` (the k8s preStop hook of the head pod)
calls `drain`, and `voxray drain --move-out-node` (the worker pods' preStop) `move_out_node`.
Draining, Routers refuse new streams at once and end those still playing at the deadline with
UNAVAILABLE and a retry hint (`router.drain`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray

from router.drain import (
    POLL_S,
    llm_replicas_on_node,
    moving_out_streams,
    open_streams_by_router,
    request_move_out,
    start_drain,
)

SETTLE_S = 3 * POLL_S  # the Routers' first reports arrive within a poll or two


@dataclass(frozen=True)
class DrainReport:
    drained_s: float  # from the start of the drain until no Router had a stream
    open_streams_left: int  # streams still open when the wait ended (0 = all finished or ended)


def drain(app_name: str, grace_s: float) -> DrainReport:
    """Drain `app_name`; returns once its Routers report no open stream, or a little after the deadline."""
    start_s = time.monotonic()
    deadline_unix_s = start_drain(app_name, grace_s)
    give_up_unix_s = deadline_unix_s + 2.0  # streams past the deadline end at their next chunk
    time.sleep(SETTLE_S)
    while True:
        counts = open_streams_by_router(app_name)
        left = sum(counts.values())
        if (counts and left == 0) or time.time() >= give_up_unix_s:
            return DrainReport(time.monotonic() - start_s, left)
        time.sleep(POLL_S)


@dataclass(frozen=True)
class MoveOutReport:
    replicas: tuple[str, ...]  # the LLM replicas asked to leave
    moved_s: float  # until none of them had a stream, or the wait ended
    streams_left: int  # streams they still held when the wait ended


def live_llm_replicas(app_name: str) -> set[str]:
    """Unique ids of the app's LLMStage replicas that are alive (Serve names their actors)."""
    prefix = f"SERVE_REPLICA::{app_name}#LLMStage#"
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)]
    return {name[len(prefix) :] for name in names if name.startswith(prefix)}


def move_out(app_name: str, replicas: list[str], timeout_s: float) -> MoveOutReport:
    """Ask `replicas` to hand their streams to the others; wait until they hold none (or `timeout_s`)."""
    start_s = time.monotonic()
    for replica in replicas:
        request_move_out(app_name, replica)
    while True:
        counts = [moving_out_streams(app_name, replica) for replica in replicas]
        answered = [count for count in counts if count is not None]
        left = sum(answered)
        if (len(answered) == len(replicas) and left == 0) or time.monotonic() - start_s >= timeout_s:
            return MoveOutReport(tuple(replicas), time.monotonic() - start_s, left)
        time.sleep(POLL_S)


def move_out_node(app_name: str, timeout_s: float) -> MoveOutReport:
    """Move the streams of this node's live LLM replicas to the others (a worker pod stopping)."""
    here = llm_replicas_on_node(app_name, ray.get_runtime_context().get_node_id())
    return move_out(app_name, sorted(set(here) & live_llm_replicas(app_name)), timeout_s)

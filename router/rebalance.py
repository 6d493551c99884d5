"""Rebalancing active streams between LLM replicas. When one replica runs many more streams than
another (the streams that failed over onto a survivor while Serve's replacement idles), the
Router's `Rebalancer` asks the busy one, through Ray's internal KV, to hand some streams off with
their KV; the LLMStage's move-out watcher takes the request (`take_rebalance_request`) and ends
those streams with `Moved(is_leaving=False)`, which the Router resumes on another replica.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import NamedTuple

from ray.experimental import internal_kv

from core.config import RebalanceConfig
from router.dispatch import active_streams_by_replica
from router.drain import KV_NAMESPACE

logger = logging.getLogger("ray.serve.voxray")


class MovePlan(NamedTuple):
    from_replica: str  # unique id of the busiest replica
    to_replica: str  # unique id of the least busy one (where the moved streams should land)
    count: int  # streams to move: half the gap


def plan_move(active_by_replica: dict[str, int], min_imbalance: int, min_busy: int = 0) -> MovePlan | None:
    """Move half the gap from the busiest replica to the least busy one when the gap is at least
    `min_imbalance` and the busiest runs at least `min_busy` streams (below that it has room: a
    move would only cost its streams a hand-off). Ties go to the smaller id, so every Router
    plans the same move."""
    if len(active_by_replica) < 2:
        return None
    busy, num_busy = min(active_by_replica.items(), key=lambda item: (-item[1], item[0]))
    idle, num_idle = min(active_by_replica.items(), key=lambda item: (item[1], item[0]))
    gap = num_busy - num_idle
    if gap < max(min_imbalance, 2) or num_busy < min_busy:  # a gap of 1 moves nothing (half of it rounds to 0)
        return None
    return MovePlan(busy, idle, gap // 2)


def _rebalance_key(app_name: str, replica: str) -> bytes:
    return f"rebalance:{app_name}:{replica}".encode()


def request_rebalance(app_name: str, replica: str, count: int) -> None:
    """Ask the LLM replica `replica` (unique id) to hand `count` of its streams to the others."""
    internal_kv._internal_kv_put(_rebalance_key(app_name, replica), str(count).encode(), namespace=KV_NAMESPACE)


def claim_rebalance(app_name: str, cooldown_s: float) -> bool:
    """True for the one Router of `app_name` that may ask for a move now: the first to claim since
    the last claim expired (each Router replica runs a Rebalancer over the same replica reports;
    two asking at once would move twice the gap). Two Routers taking over an expired claim in the
    same instant both get it: rare, and the next cooldown evens out what they moved."""
    key, now_s = f"rebalance-claim:{app_name}:".encode(), time.time()
    claim = str(now_s + cooldown_s).encode()
    if not internal_kv._internal_kv_put(key, claim, overwrite=False, namespace=KV_NAMESPACE):
        return True  # nobody held it
    held = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    if held is not None and float(held) > now_s:
        return False
    internal_kv._internal_kv_put(key, claim, namespace=KV_NAMESPACE)  # expired: take it over
    return True


def take_rebalance_request(app_name: str, replica: str) -> int:
    """Streams the replica was asked to hand off since it last looked (0: none), forgetting the request."""
    key = _rebalance_key(app_name, replica)
    value = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    if value is None:
        return 0
    internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
    return int(value)


class Rebalancer:
    """One Router replica's rebalancing loop: every `period_s` it reads the LLM load board, plans a
    move and asks the busy replica for it (unless another Router of the app just did), then lets
    `cooldown_s` pass (the reports catch up with the move) before planning again. `loads` and
    `ask` (True when it asked) are injectable for tests."""

    def __init__(
        self,
        app_name: str,
        config: RebalanceConfig,
        loads: Callable[[], dict[str, int]] | None = None,
        ask: Callable[[str, int], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_streams_per_replica: int = 0,
        scope: str | None = None,
    ) -> None:
        self.app_name, self.config = app_name, config
        self.scope = scope or app_name  # the LLM deployment's board (`dispatch.board_scope`): one model's replicas
        self.min_busy = math.ceil(config.min_busy_share * max_streams_per_replica)
        self.loads = loads if loads is not None else lambda: active_streams_by_replica(self.scope)
        self.ask = ask if ask is not None else self._ask_through_kv
        self.clock = clock
        self.quiet_until_s = 0.0  # no plan before then (the cooldown after the last ask)
        self.num_asked = 0  # moves this Router asked for
        self.last_asked: MovePlan | None = None
        self._task: asyncio.Task | None = None

    def plan(self) -> MovePlan | None:
        """The move to ask for now (None: cooling down, or balanced enough); starts the cooldown
        (whether this Router asks or another one did)."""
        now_s = self.clock()
        if now_s < self.quiet_until_s:
            return None
        plan = plan_move(self.loads(), self.config.min_imbalance, self.min_busy)
        if plan is not None:
            self.quiet_until_s = now_s + self.config.cooldown_s
        return plan

    async def tick(self) -> MovePlan | None:
        """The move this Router asked for now, if any. Plans on the event loop (the board is read
        there, as the admission checks read it); asks off it (GCS calls)."""
        plan = self.plan()
        if plan is None or not await asyncio.to_thread(self.ask, plan.from_replica, plan.count):
            return None
        # the same plan again: the replica had nothing it could move (streaming-text streams)
        level = logging.DEBUG if plan == self.last_asked else logging.INFO
        self.num_asked, self.last_asked = self.num_asked + 1, plan
        busy, idle, count = plan
        logger.log(level, "rebalance: asked LLM replica %s to move %d streams (to %s)", busy, count, idle)
        return plan

    def _ask_through_kv(self, replica: str, count: int) -> bool:
        if not claim_rebalance(self.scope, self.config.cooldown_s):
            return False  # another Router asked: its move is under way
        request_rebalance(self.app_name, replica, count)
        return True

    def start(self) -> None:
        """Run on the caller's event loop (the Router replica's), when the config enables it."""
        if self.config.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="voxray-rebalance")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.period_s)
            try:
                await self.tick()
            except Exception as err:  # the GCS is away (the cluster stopping): try again next period
                logger.warning("rebalance: %s: %s", type(err).__name__, err)

"""Rebalancing streams between LLM replicas (router.rebalance): the pure plan, the Rebalancer's
asks and cooldown on a fake clock, the load board it reads and the brief pass-over of a replica
rebalanced from (router.dispatch), the Router counting only leaving moves against MAX_MOVES, and
the config's validation. No Ray cluster: the cluster test is tests/deployments/test_zz_rebalance.py."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError
from ray.serve._private.common import ReplicaID

from core.config import RebalanceConfig, ServeConfig
from core.messages import Failed, Moved, ResumeState
from router import rebalance
from router.dispatch import active_streams_by_replica, pass_over
from router.rebalance import (
    MovePlan,
    Rebalancer,
    claim_rebalance,
    plan_move,
    request_rebalance,
    take_rebalance_request,
)
from router.streams import MAX_MOVES, RouterCore, StreamFailed
from tests.router.test_dispatch import APP, DEPLOYMENT, Replica, _board, report


@pytest.mark.parametrize(
    ("active", "min_imbalance", "plan"),
    [
        ({"a": 4, "b": 0}, 2, MovePlan("a", "b", 2)),  # the failover case: survivor 4, replacement 0
        ({"a": 0, "b": 5}, 2, MovePlan("b", "a", 2)),  # half the gap, rounded down
        ({"a": 3, "b": 2}, 2, None),  # a gap of 1 never moves
        ({"a": 4, "b": 2}, 3, None),  # below min_imbalance
        ({"a": 2, "b": 2}, 2, None),
        ({"a": 6}, 2, None),  # one replica: nowhere to go
        ({}, 2, None),
        ({"a": 1, "b": 7, "c": 4}, 2, MovePlan("b", "a", 3)),  # busiest to least busy
        ({"b": 4, "a": 4, "d": 0, "c": 0}, 2, MovePlan("a", "c", 2)),  # ties: smaller ids, the same on every Router
    ],
)
def test_plan_move(active, min_imbalance, plan):
    assert plan_move(active, min_imbalance) == plan


def test_a_busiest_replica_with_room_moves_nothing():
    """Below `min_busy` streams the busiest has room: the tail of a failover, whose streams ended
    on one side, is left alone rather than sent back."""
    assert plan_move({"a": 2, "b": 0}, 2, min_busy=3) is None
    assert plan_move({"a": 4, "b": 0}, 2, min_busy=3) == MovePlan("a", "b", 2)
    rebalancer = Rebalancer(APP, RebalanceConfig(min_busy_share=0.75), loads=lambda: {"a": 2, "b": 0},
                            ask=_Asks(), max_streams_per_replica=4)  # fmt: skip
    assert rebalancer.min_busy == 3 and rebalancer.plan() is None


class _Asks(list):
    """The asks a Rebalancer made, as (replica, count); `granted` False: another Router holds the claim."""

    def __init__(self, granted: bool = True) -> None:
        super().__init__()
        self.granted = granted

    def __call__(self, replica: str, count: int) -> bool:
        if self.granted:
            self.append((replica, count))
        return self.granted


def _rebalancer(active: dict[str, int], clock: list[float], asks: _Asks | None = None, **config):
    asked = asks if asks is not None else _Asks()
    rebalancer = Rebalancer(
        APP, RebalanceConfig(**config), loads=lambda: dict(active), ask=asked, clock=lambda: clock[0]
    )  # fmt: skip
    return rebalancer, asked


def test_the_rebalancer_asks_the_busy_replica_then_cools_down():
    clock, active = [100.0], {"survivor": 4, "replacement": 0}
    rebalancer, asked = _rebalancer(active, clock, cooldown_s=3.0)
    assert asyncio.run(rebalancer.tick()) == MovePlan("survivor", "replacement", 2)
    assert asked == [("survivor", 2)]
    clock[0] += 2.9  # the reports have not caught up yet: asking again would move too many
    assert asyncio.run(rebalancer.tick()) is None and asked == [("survivor", 2)]
    clock[0] += 0.2
    assert asyncio.run(rebalancer.tick()) == MovePlan("survivor", "replacement", 2)  # still unbalanced: again
    active.update(survivor=2, replacement=2)
    clock[0] += 10.0
    assert asyncio.run(rebalancer.tick()) is None and len(asked) == 2 == rebalancer.num_asked


def test_a_balanced_board_starts_no_cooldown():
    clock, active = [0.0], {"a": 1, "b": 1}
    rebalancer, asked = _rebalancer(active, clock)
    assert asyncio.run(rebalancer.tick()) is None
    active["a"] = 5  # the imbalance appears right after: asked at once, no cooldown in the way
    assert asyncio.run(rebalancer.tick()) == MovePlan("a", "b", 2) and asked == [("a", 2)]


def test_a_router_cools_down_when_another_one_asked():
    """Every Router replica runs a Rebalancer over the same reports: one claim per cooldown asks."""
    clock, asks = [0.0], _Asks(granted=False)
    rebalancer, _ = _rebalancer({"a": 4, "b": 0}, clock, asks, cooldown_s=3.0)
    assert asyncio.run(rebalancer.tick()) is None and asks == [] and rebalancer.num_asked == 0
    asks.granted = True
    clock[0] += 1.0  # the other Router's move is under way: this one waits its cooldown too
    assert asyncio.run(rebalancer.tick()) is None and asks == []
    clock[0] += 2.5
    assert asyncio.run(rebalancer.tick()) == MovePlan("a", "b", 2) and asks == [("a", 2)]


def test_the_rebalancer_runs_on_the_event_loop_and_stops_cleanly():
    async def run() -> tuple[list, list]:
        enabled, asked_enabled = _rebalancer({"a": 3, "b": 0}, [0.0], period_s=0.01, cooldown_s=0.0)
        disabled, asked_disabled = _rebalancer({"a": 3, "b": 0}, [0.0], period_s=0.01, enabled=False)
        enabled.start()
        disabled.start()
        await asyncio.sleep(0.1)
        await enabled.stop()
        await disabled.stop()
        num_asked = len(asked_enabled)
        await asyncio.sleep(0.05)  # stopped: no more asks
        assert len(asked_enabled) == num_asked
        return asked_enabled, asked_disabled

    asked_enabled, asked_disabled = asyncio.run(run())
    assert asked_enabled and asked_enabled[0] == ("a", 1) and asked_disabled == []


def test_the_rebalancer_survives_an_ask_that_fails():
    """The GCS away (the cluster stopping) costs one period, not the loop."""

    def ask(replica: str, count: int) -> bool:
        calls.append(replica)
        raise ConnectionError("GCS unavailable")

    async def run() -> None:
        rebalancer = Rebalancer(APP, RebalanceConfig(period_s=0.01, cooldown_s=0.0), loads=lambda: {"a": 4, "b": 0},
                                ask=ask)  # fmt: skip
        rebalancer.start()
        for _ in range(1000):  # until a second ask came after the first failed (a slow box takes longer)
            if len(calls) >= 2:
                break
            await asyncio.sleep(0.01)
        await rebalancer.stop()

    calls: list[str] = []
    asyncio.run(run())
    assert len(calls) >= 2


@pytest.fixture
def kv_store(monkeypatch) -> dict:
    """Ray's internal KV as a dict (its put answers whether the key existed; overwrite=False keeps it)."""
    store: dict[tuple[bytes, str], bytes] = {}

    def put(key: bytes, value: bytes, overwrite: bool = True, *, namespace: str) -> bool:
        existed = (key, namespace) in store
        if overwrite or not existed:
            store[(key, namespace)] = value
        return existed

    kv = rebalance.internal_kv
    monkeypatch.setattr(kv, "_internal_kv_put", put)
    monkeypatch.setattr(kv, "_internal_kv_get", lambda key, namespace: store.get((key, namespace)))
    monkeypatch.setattr(kv, "_internal_kv_del", lambda key, namespace: store.pop((key, namespace), None))
    return store


def test_one_router_of_an_app_claims_each_cooldown(kv_store, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(rebalance.time, "time", lambda: now[0])
    assert claim_rebalance("app", 3.0) and not claim_rebalance("app", 3.0)  # the second Router waits
    assert claim_rebalance("other-app", 3.0)
    now[0] += 3.1
    assert claim_rebalance("app", 3.0) and not claim_rebalance("app", 3.0)  # expired: taken over once


def test_requests_go_through_the_internal_kv_once(kv_store):
    """A request is taken once (the replica moves that many, once); a later one replaces an earlier."""
    assert take_rebalance_request("app", "r1") == 0
    request_rebalance("app", "r1", 3)
    request_rebalance("app", "r1", 2)
    assert take_rebalance_request("other-app", "r1") == 0 and take_rebalance_request("app", "r2") == 0
    assert take_rebalance_request("app", "r1") == 2
    assert take_rebalance_request("app", "r1") == 0


def test_the_board_counts_active_streams_and_passes_a_rebalanced_replica_over_briefly():
    async def run() -> None:
        clock = [5000.0]
        board, r1 = await _board(clock)
        r1.routing_stats = report(4, clock[0])
        r2 = Replica(ReplicaID(unique_id="r2", deployment_id=DEPLOYMENT), report(0, clock[0]))
        r3 = Replica(ReplicaID(unique_id="r3", deployment_id=DEPLOYMENT))  # not reported yet: not counted
        board.update_replicas([r1, r2, r3])
        assert active_streams_by_replica(APP) == {"r1": 4, "r2": 0}
        r1.routing_stats, r2.routing_stats = report(1, clock[0]), report(3, clock[0])  # r1 would go first ...
        pass_over(APP, "LLMStage#r1", for_s=2.0)  # ... but it just handed streams off to rebalance
        ranked = await board.choose_replicas([r1, r2])
        assert [r[0].replica_id.unique_id for r in ranked] == ["r2", "r1"]
        clock[0] += 2.1
        ranked = await board.choose_replicas([r1, r2])
        assert [r[0].replica_id.unique_id for r in ranked] == ["r1", "r2"]  # not for good
        assert not board.passed_over_until  # forgotten once past
        pass_over(APP, "LLMStage#r1")  # leaving: for good, and off the rebalancing board
        clock[0] += 60.0
        ranked = await board.choose_replicas([r1, r2])
        assert [r[0].replica_id.unique_id for r in ranked] == ["r2", "r1"]
        assert active_streams_by_replica(APP) == {"r2": 3}

    asyncio.run(run())


class _MovingLLM:
    """An LLM handle whose every call answers with a Moved head (`is_leaving` as given), `num_moves`
    times, then with Failed (ending the stream with a message of its own)."""

    def __init__(self, is_leaving: bool, num_moves: int) -> None:
        self.is_leaving, self.num_moves, self.calls = is_leaving, num_moves, 0
        self.generate = self

    def options(self, **kwargs) -> _MovingLLM:
        return self

    def remote(self, job):
        self.calls += 1
        if self.calls > self.num_moves:
            return _Events([Failed("end")])
        return _Events([Moved(ResumeState((), 0, 0), "LLMStage#busy", self.is_leaving)])


class _Events:
    def __init__(self, events: list) -> None:
        self.events = iter(events)

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self):
        try:
            return next(self.events)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        pass


def _play_moved(is_leaving: bool, num_moves: int) -> str:
    async def run() -> str:
        core = RouterCore(ServeConfig(app_name="moves-test").model_dump(), _MovingLLM(is_leaving, num_moves), None)
        with pytest.raises(StreamFailed) as failed:
            job = core.job(text="moved", model="", voice="", sampling={}, output_format="pcm16", sample_rate_hz=0,
                           ttfa_deadline_s=0.0, req_id="m")  # fmt: skip
            async for _ in core.run(job):
                pass
        return str(failed.value)

    return asyncio.run(run())


def test_only_leaving_moves_count_against_max_moves():
    failed = _play_moved(is_leaving=True, num_moves=MAX_MOVES + 1)
    assert failed == f"moved {MAX_MOVES + 1} times without a replica taking it"
    assert _play_moved(is_leaving=False, num_moves=MAX_MOVES + 3) == "end"  # rebalanced that often: still served


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"min_imbalance": 1}, "min_imbalance"),
        ({"period_s": 0}, "period_s"),
        ({"cooldown_s": -1.0}, "cooldown_s"),
        ({"pass_over_s": -0.5}, "pass_over_s"),
        ({"every_s": 1.0}, "every_s"),
    ],
)
def test_config_refuses_bad_fields_naming_them(fields, field):
    with pytest.raises(ValidationError, match=field):
        ServeConfig.model_validate({"rebalance": fields})


def test_config_defaults():
    config = ServeConfig().rebalance
    assert (config.enabled, config.min_imbalance, config.period_s, config.cooldown_s) == (True, 2, 1.0, 3.0)

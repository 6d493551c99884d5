"""The LLM replicas' load board (router.dispatch.PredictedTTFARouter) between two reports: the
requests it routed and saw complete after a report was measured count on top of it. No Ray
cluster: replicas are stand-ins carrying the stats Serve hands the router."""

import asyncio
from dataclasses import dataclass, field

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from router.admission import ReplicaLoad, admits_anywhere
from router.detok_load import DetokPace
from router.dispatch import CHOOSING_KEEP_S, DetokBoard, PredictedTTFARouter, detok_loads, estimated_loads

APP = "board-test"
DEPLOYMENT = DeploymentID(name="LLMStage", app_name=APP)


@dataclass
class Replica:
    """What the router reads of a running replica: its id and its last routing stats."""

    replica_id: ReplicaID
    routing_stats: dict = field(default_factory=dict)
    multiplexed_model_ids: set = field(default_factory=set)  # read by Serve's default (power-of-two) router
    node_id: str = "node"
    availability_zone: str | None = None

    async def get_queue_len(self, deadline_s: float) -> int:  # Serve's router probes new replicas
        return 0


def report(num_active: int, at_unix_s: float) -> dict:
    return ReplicaLoad(num_active=num_active, max_streams=4, max_queued=0, step_s=0.01, first_chunk_tokens=10,
                       avg_stream_s=2.0, reported_unix_s=at_unix_s).to_stats()  # fmt: skip


def pending(req_id: str) -> PendingRequest:
    return PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id=req_id, internal_request_id=req_id))


async def _board(clock: list[float]) -> tuple[PredictedTTFARouter, Replica]:
    board = PredictedTTFARouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN, get_curr_time_s=lambda: clock[0])
    board.initialize_state()
    replica = Replica(ReplicaID(unique_id="r1", deployment_id=DEPLOYMENT), report(0, clock[0]))
    board.update_replicas([replica])
    return board, replica


async def _route(board: PredictedTTFARouter, replica: Replica, req_id: str) -> None:
    await board.choose_replicas([replica], pending(req_id))
    board.on_request_routed(pending(req_id), replica.replica_id, None)


def test_streams_ending_after_a_burst_count_before_the_next_report_arrives():
    async def run() -> None:
        clock = [1000.0]
        board, replica = await _board(clock)
        for i in range(4):  # a burst fills the replica (max_streams 4, no queue)
            clock[0] += 0.01
            await _route(board, replica, f"burst-{i}")
        assert [load.num_active for load in estimated_loads(APP)] == [4]
        assert not admits_anywhere(estimated_loads(APP), deadline_s=60.0)
        replica.routing_stats = report(4, clock[0])  # measured with the burst running ...
        clock[0] += 0.2
        for _ in range(4):  # ... and the burst ends before that report reaches the router
            board.on_request_completed(replica.replica_id, "done")
        assert [load.num_active for load in estimated_loads(APP)] == [0]
        assert admits_anywhere(estimated_loads(APP), deadline_s=60.0)
        clock[0] += 0.3
        replica.routing_stats = report(0, clock[0])  # the next report: the completions are in it now
        assert [load.num_active for load in estimated_loads(APP)] == [0]

    asyncio.run(run())


def test_a_report_measured_after_requests_arrived_replaces_their_count():
    async def run() -> None:
        clock = [2000.0]
        board, replica = await _board(clock)
        clock[0] += 0.01
        await _route(board, replica, "a")
        await _route(board, replica, "b")
        assert [load.num_active for load in estimated_loads(APP)] == [2]
        clock[0] += 0.5
        replica.routing_stats = report(2, clock[0])  # they reached the replica: counted once, not twice
        assert [load.num_active for load in estimated_loads(APP)] == [2]
        clock[0] += 0.01
        board.on_request_completed(replica.replica_id, "a")
        assert [load.num_active for load in estimated_loads(APP)] == [1]

    asyncio.run(run())


def test_the_detok_handles_board_never_replaces_the_llm_board():
    """Both boards live in one process (the Router calls the detok stage too): each in its own place."""

    async def run() -> None:
        llm_board, replica = await _board([3000.0])
        detok_id = DeploymentID(name="DetokStage", app_name=APP)
        detok_board = DetokBoard(deployment_id=detok_id, handle_source=DeploymentHandleSource.UNKNOWN)
        detok_board.initialize_state()
        detok = Replica(ReplicaID(unique_id="d1", deployment_id=detok_id))
        detok.routing_stats = DetokPace().load(num_queued_chunks=3).to_stats()
        detok_board.update_replicas([detok])
        assert [load.num_active for load in estimated_loads(APP)] == [0]  # still the LLM board's
        assert [load.num_queued_chunks for load in detok_loads(APP)] == [3]

    asyncio.run(run())


def test_a_request_abandoned_while_being_routed_stops_counting():
    """A client that leaves while its request is ranked: it is never sent, so never routed nor
    completed. It counted on the board for good, and three such locked an idle app out (fuzz run)."""

    async def run() -> None:
        clock = [4000.0]
        board, replica = await _board(clock)
        for i in range(3):
            await board.choose_replicas([replica], pending(f"gone-{i}"))  # ranked, then the client left
        assert [load.num_active for load in estimated_loads(APP)] == [3]
        clock[0] += CHOOSING_KEEP_S + 0.1
        assert [load.num_active for load in estimated_loads(APP)] == [0]
        assert admits_anywhere(estimated_loads(APP), deadline_s=5.0)

    asyncio.run(run())


def test_a_replica_serve_stops_alive_is_asked_to_move_its_streams_out():
    """Scale-down / redeploy: Serve drops a live replica from the running set; the router asks it to
    hand its streams off (router.drain). One whose actor died is not asked (its streams fail over)."""

    async def run() -> None:
        board, first = await _board([1000.0])
        second = Replica(ReplicaID(unique_id="r2", deployment_id=DEPLOYMENT))
        third = Replica(ReplicaID(unique_id="r3", deployment_id=DEPLOYMENT))
        board.update_replicas([first, second, third])
        assert board.asked_to_move_out == []  # replicas joining ask nothing
        board.update_replicas([first, third])  # Serve stops r2
        board.on_replica_actor_died(third.replica_id)  # r3 dies
        board.update_replicas([first])
        assert board.asked_to_move_out == ["r2"]

    asyncio.run(run())

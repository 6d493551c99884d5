"""The LLM replicas' load board (router.dispatch.PredictedTTFARouter) between two reports: the
requests it routed and saw complete after a report was measured count on top of it. No Ray
cluster: replicas are stand-ins carrying the stats Serve hands the router. Its ranking counts a
request's own prompt work (a long spoken prompt's prefill at each replica's measured pace)."""

import asyncio
from dataclasses import dataclass, field, replace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from core.messages import AudioClip, Job
from llm_stage.jobs import build_job
from llm_stage.models.step_audio2 import StepAudio2Adapter
from llm_stage.prompt_work import PromptWork, prompt_work
from router.admission import ReplicaLoad, admits_anywhere, predict_ttfa_s
from router.detok_load import DetokPace
from router.dispatch import (
    _PROMPT_WORK,
    CHOOSING_KEEP_S,
    DetokBoard,
    PredictedTTFARouter,
    detok_loads,
    estimated_loads,
    rank_with_prompt_work,
)

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


# Two replicas, each better at one thing: "quick-steps" decodes faster but prefills slowly (2000
# prompt positions a second beyond a step), "quick-prefill" steps 5 ms slower and prefills 10x faster.
RANKING = DeploymentID(name="LLMStage", app_name="rank-test")
QUICK_STEPS = ReplicaLoad(num_active=2, max_streams=8, max_queued=2, step_s=0.020, first_chunk_tokens=24,
                          avg_stream_s=6.0, prefill_tokens_per_s=2_000.0, encoder_s_per_audio_s=0.02,
                          reported_unix_s=5000.0)  # fmt: skip
QUICK_PREFILL = replace(QUICK_STEPS, step_s=0.025, prefill_tokens_per_s=20_000.0)


def spoken(duration_s: float) -> Job:
    """A Step-Audio 2 request carrying `duration_s` of audio (~12.6 prompt positions a second)."""
    return build_job(StepAudio2Adapter, text="", audio=AudioClip(b"\x01\x00" * round(duration_s * 16_000), 16_000))


def calling(*args) -> PendingRequest:
    return PendingRequest(args=list(args), kwargs={}, metadata=RequestMetadata(request_id="q", internal_request_id="q"))


async def _ranking_board(estimates: list[Job]) -> tuple[PredictedTTFARouter, list[Replica]]:
    """A board over both replicas; the Router's estimate registered for it records every Job it is asked of."""

    def estimate(job: Job) -> PromptWork:
        estimates.append(job)
        return prompt_work(StepAudio2Adapter, job)

    rank_with_prompt_work("rank-test", estimate)
    board = PredictedTTFARouter(RANKING, DeploymentHandleSource.UNKNOWN, get_curr_time_s=lambda: 5000.0)
    board.initialize_state()
    replicas = [Replica(ReplicaID(unique_id=name, deployment_id=RANKING), load.to_stats())
                for name, load in (("quick-steps", QUICK_STEPS), ("quick-prefill", QUICK_PREFILL))]  # fmt: skip
    board.update_replicas(replicas)
    return board, replicas


async def _first_choice(board: PredictedTTFARouter, replicas: list[Replica], request: PendingRequest) -> str:
    ranked = await board.choose_replicas(replicas, request)
    return ranked[0][0].replica_id.unique_id


def test_a_long_spoken_prompt_is_ranked_onto_the_replica_that_prefills_faster():
    """Ranked without its prompt work, a 50 s clip (649 positions) went where a 1 s one goes: to the
    replica with the quicker step, whose slow prefill makes its first audio 0.17 s later (1.82 s vs 1.66 s)."""

    async def run() -> None:
        estimates: list[Job] = []
        board, replicas = await _ranking_board(estimates)
        try:
            short, long = spoken(1.0), spoken(50.0)
            short_work, long_work = (prompt_work(StepAudio2Adapter, job) for job in (short, long))
            assert predict_ttfa_s(QUICK_STEPS, work=short_work) < predict_ttfa_s(QUICK_PREFILL, work=short_work)
            assert predict_ttfa_s(QUICK_STEPS, work=long_work) > predict_ttfa_s(QUICK_PREFILL, work=long_work)
            assert predict_ttfa_s(QUICK_STEPS) < predict_ttfa_s(QUICK_PREFILL)  # no work: the quicker step wins
            assert await _first_choice(board, replicas, calling(short)) == "quick-steps"
            assert await _first_choice(board, replicas, calling(long)) == "quick-prefill"
            assert estimates == [short, long]  # once per ranking, not once per replica ranked
            # a call carrying no Job (a stats call, no args) is ranked as before: by the step alone
            assert await _first_choice(board, replicas, calling()) == "quick-steps"
            assert await _first_choice(board, replicas, calling("stats")) == "quick-steps"
            assert estimates == [short, long]
        finally:
            _PROMPT_WORK.pop("rank-test", None)

    asyncio.run(run())


def test_a_larger_prefill_budget_wins_a_long_prompt_at_the_same_pace():
    """A prompt longer than a replica's per-step prefill budget takes a step more per budget's worth:
    with the same pace, the replica prefilling 1024 positions a step beats the one prefilling 64."""

    async def run() -> None:
        board, replicas = await _ranking_board([])
        try:
            replicas[0].routing_stats = replace(QUICK_STEPS, prefill_token_budget=64).to_stats()
            replicas[1].routing_stats = replace(QUICK_STEPS, step_s=0.021, prefill_token_budget=1024).to_stats()
            assert await _first_choice(board, replicas, calling(spoken(1.0))) == replicas[0].replica_id.unique_id
            assert await _first_choice(board, replicas, calling(spoken(50.0))) == replicas[1].replica_id.unique_id
        finally:
            _PROMPT_WORK.pop("rank-test", None)

    asyncio.run(run())


def test_without_a_registered_estimate_a_job_is_ranked_as_before():
    """A process whose Router registered no estimate for this deployment ranks a Job by the step alone."""

    async def run() -> None:
        board, replicas = await _ranking_board([])
        _PROMPT_WORK.pop("rank-test", None)
        assert await _first_choice(board, replicas, calling(spoken(50.0))) == "quick-steps"

    asyncio.run(run())

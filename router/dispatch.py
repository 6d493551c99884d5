"""Data-parallel dispatch: a Serve RequestRouter that sends each request to the LLM replica
with the lowest predicted TTFA, and per-process load boards for admission.

Replicas publish a `ReplicaLoad` through `record_routing_stats`, stamped with the time they
measured it; this router counts the requests it routed and saw complete after that time, so a
burst neither piles onto one replica nor waits for the next refresh, and streams ending after a
burst count at once (a report measured before they ended arrives up to a stats period later).
A request carrying a Job is ranked with its own prompt work (a long spoken prompt's prefill at each
replica's measured pace), estimated once per ranking as the Router's admission estimates it.
The Router ingress reads `estimated_loads` to reject at once when no replica admits (the
LLMStage replica still makes the final decision). The detok handle's router (`DetokBoard`,
power-of-two routing as Serve's default) keeps the detok replicas' `DetokLoad` reports where
the LLM replica calling them reads them (`detok_loads`).
A `TextPiece` (more text for a streaming-text job) goes to the replica running that job, uncounted; a
`MicPiece` to the replica tokenizing its turn (the first one: ranked as a request is), uncounted.
"""

from __future__ import annotations

import importlib
import threading
from collections import defaultdict, deque
from collections.abc import Callable

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # Serve's default router
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from core.messages import Job, MicPiece, TextPiece
from llm_stage.prompt_work import PromptWork
from router.admission import ReplicaLoad, predict_ttfa_s
from router.detok_load import DetokLoad
from router.drain import request_move_out

CHOOSING_KEEP_S = 5.0  # a ranked request not sent by then was abandoned (routing takes milliseconds)
UNREPORTED_EVENTS_KEEP_S = 60.0  # routed / completed counts kept for a replica that never reported

_BOARDS: dict[str, PredictedTTFARouter] = {}  # board scope -> the LLMStage router living in this process
_DETOK_BOARDS: dict[str, DetokBoard] = {}  # board scope -> the DetokStage router living in this process
# board scope -> the Router's estimate of a Job's prompt work for that LLM deployment's family
_PROMPT_WORK: dict[str, Callable[[Job], PromptWork]] = {}
# Deployments named as in a single-model app: their boards are found by the app's name alone
SINGLE_MODEL_DEPLOYMENTS = frozenset({"LLMStage", "DetokStage"})


def board_scope(app_name: str, deployment_name: str) -> str:
    """Where one deployment's board is kept in a process: the app's name for a single-model app's
    `LLMStage` / `DetokStage`, `app:deployment` for a multi-model app's per-model deployments (the
    Router holds a handle, so a board, for each of them). App names have no `:` (ServeConfig.app_name)."""
    return app_name if deployment_name in SINGLE_MODEL_DEPLOYMENTS else f"{app_name}:{deployment_name}"


def handle_scope(handle, app_name: str) -> str:
    """The board scope of the deployment `handle` calls (a stand-in without a deployment name: the app's)."""
    deployment_name = getattr(handle, "deployment_name", None)
    return board_scope(app_name, deployment_name) if isinstance(deployment_name, str) else app_name


def _register(scope: str, board: PredictedTTFARouter | DetokBoard, boards: str) -> None:
    """Put `board` in the module's `boards` dict, where `estimated_loads` / `detok_loads` look.
    Through the imported module, not this function's globals (nor its classes, for isinstance):
    Serve ships the router class to the replica by value, with copies of them."""
    getattr(importlib.import_module(type(board).__module__), boards)[scope] = board


def _own_scope(board: RequestRouter) -> str:
    """The scope a deployment's request router registers its board under (`board_scope`)."""
    deployment_id = getattr(board, "_deployment_id", None)
    name = getattr(deployment_id, "name", None)
    return board_scope(board.app_name, name) if isinstance(name, str) else board.app_name


def rank_with_prompt_work(scope: str, estimate: Callable[[Job], PromptWork]) -> None:
    """Rank the LLM replicas at `scope` for a request carrying a Job with its own prompt work, as
    `estimate` gives it (the RouterCore's: the family's figures, as its admission checks use)."""
    _PROMPT_WORK[scope] = estimate


def detok_loads(scope: str) -> list[DetokLoad]:
    """The last report of every detok replica at `scope` this process calls ([] = none yet)."""
    board = _DETOK_BOARDS.get(scope)
    if board is None:
        return []
    loads = [DetokLoad.from_stats(replica.routing_stats or {}) for replica in list(board.curr_replicas.values())]
    return [load for load in loads if load is not None]


def live_detok_replicas(scope: str) -> dict[str, int]:
    """Unique id -> streams its last report counts (0 before one), of every detok replica of
    `scope` the handle in this process may call ({} = not listed yet)."""
    board = _DETOK_BOARDS.get(scope)
    if board is None:
        return {}
    live = {}
    for replica_id, replica in list(board.curr_replicas.items()):  # (a copy: Serve updates it elsewhere)
        load = DetokLoad.from_stats(replica.routing_stats or {})
        live[replica_id.unique_id] = load.num_streams if load is not None else 0
    return live


def estimated_loads(scope: str) -> list[ReplicaLoad]:
    """Current load estimate of every LLM replica at `scope` known to this process ([] = unknown)."""
    router = _BOARDS.get(scope)
    return router.estimated_loads() if router is not None else []


def num_live_replicas(scope: str) -> int | None:
    """LLM replicas at `scope` this process may still route to, once one of them has died
    (None before: at start-up Serve has not listed the replicas yet, which is not an outage).
    Serve drops a replica from this set as soon as a call to it fails with ActorDiedError."""
    router = _BOARDS.get(scope)
    if router is None or not router.has_lost_replicas:
        return None
    return len(router.curr_replicas)


def active_streams_by_replica(scope: str) -> dict[str, int]:
    """Streams each reporting LLM replica at `scope` runs (by unique id), as this process estimates
    them; a leaving replica is left out (it takes nothing, and its report says it is full)."""
    router = _BOARDS.get(scope)
    return router.active_streams_by_replica() if router is not None else {}


def pass_over(scope: str, replica_tag: str, for_s: float | None = None) -> None:
    """Rank the LLM replica `replica_tag` (`LLMStage#<id>`) last: from now on when it is leaving and
    hands its streams back (its own load report says so too, but only at its next stats refresh), for
    `for_s` when it handed a few streams off to rebalance (they, and new ones, land elsewhere)."""
    router = _BOARDS.get(scope)
    if router is None or not replica_tag:
        return
    unique_id = replica_tag.rsplit("#", 1)[-1]
    if for_s is None:
        router.leaving.add(unique_id)
    else:
        until_s = router._get_curr_time_s() + for_s
        router.passed_over_until[unique_id] = max(until_s, router.passed_over_until.get(unique_id, 0.0))


class PredictedTTFARouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        """Serve calls this right after construction (so `_ensure_state` alone never registered the board)."""
        # (unix time, +1 routed / -1 completed) per replica, since the time of its last report
        self._events: dict[ReplicaID, deque[tuple[float, int]]] = defaultdict(deque)
        self._replicas_seen: dict[ReplicaID, RunningReplica] = {}
        # request -> (replica it was ranked first on, when), not yet sent; a request whose client left
        # while it was being routed is never sent: it stops counting after CHOOSING_KEEP_S
        self._choosing: dict[str, tuple[ReplicaID, float]] = {}
        self._pinned: set[str] = set()  # pieces in flight (text, a microphone turn's): not counted as streams
        self.leaving: set[str] = set()  # unique ids of replicas handing their streams off
        self.passed_over_until: dict[str, float] = {}  # unique id -> ranked last until then (rebalanced from)
        self.has_lost_replicas = False  # a replica died since start (then an empty set is an outage)
        self._listed: set[str] = set()  # unique ids Serve last listed as running
        self._died: set[str] = set()  # unique ids whose actor died (no move-out to ask for)
        self.asked_to_move_out: list[str] = []  # unique ids of stopping replicas asked to move their streams out
        _register(_own_scope(self), self, "_BOARDS")  # the Router's early reject and deadline check read it

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.has_lost_replicas = True
        self._died.add(replica_id.unique_id)
        super().on_replica_actor_died(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new set of running replicas. One that left it alive is stopping (a scale-down, a
        redeploy): Serve would wait for its streams to end, so it is asked to move them out (KV
        included) to the others at once (`router.drain`); every Router asks, the first one counts."""
        self._ensure_state()
        now = {r.replica_id.unique_id for r in replicas}
        leaving = sorted(self._listed - now - self._died)
        self._listed = now
        super().update_replicas(replicas)
        if leaving:
            self.asked_to_move_out.extend(leaving)
            threading.Thread(target=_ask_to_move_out, args=(self.app_name, leaving), daemon=True).start()

    def _ensure_state(self) -> None:
        if not hasattr(self, "_events"):
            self.initialize_state()

    def _pending(self, replica_id: ReplicaID, since_unix_s: float) -> int:
        """Requests routed less those completed after `since_unix_s`, and those being routed."""
        events = self._events[replica_id]
        while events and events[0][0] <= since_unix_s:
            events.popleft()
        since_s = self._get_curr_time_s() - CHOOSING_KEEP_S
        self._choosing = {key: (rid, at) for key, (rid, at) in self._choosing.items() if at > since_s}
        choosing = sum(1 for rid, _ in self._choosing.values() if rid == replica_id)
        return sum(delta for _, delta in events) + choosing

    def _refresh(self, replica: RunningReplica) -> ReplicaLoad | None:
        """The replica's last report plus what this router routed to it and saw complete since the
        report was measured (a report arrives up to a stats period after that)."""
        self._replicas_seen[replica.replica_id] = replica
        load = ReplicaLoad.from_stats(replica.routing_stats or {})
        if load is None:
            self._pending(replica.replica_id, self._get_curr_time_s() - UNREPORTED_EVENTS_KEEP_S)
            return None
        pending = self._pending(replica.replica_id, load.reported_unix_s)
        num_starting = load.num_starting + max(0, pending)  # a request routed since then is starting
        return ReplicaLoad(**{**load.to_stats(), "num_active": max(0, load.num_active + pending),
                              "num_starting": num_starting})  # fmt: skip

    def _is_passed_over(self, unique_id: str) -> bool:
        return unique_id in self.leaving or self.passed_over_until.get(unique_id, 0.0) > self._get_curr_time_s()

    def _score(self, replica: RunningReplica, work: PromptWork | None = None) -> tuple[float, int]:
        """Predicted TTFA of the request (bringing its own prompt work `work`; None: none known) on
        `replica`, then its active streams; a passed-over replica last, an unreported one by its count."""
        if self._is_passed_over(replica.replica_id.unique_id):
            return (float("inf"), 0)
        load = self._refresh(replica)
        if load is None:  # no stats yet: spread by what we routed or are routing
            routed = max(0, self._pending(replica.replica_id, 0.0))
            return (float(routed), routed)
        return (predict_ttfa_s(load, work=load.work_here(work)), load.num_active)

    def _prompt_work(self, request: PendingRequest | None) -> PromptWork | None:
        """The request's own prompt work, from its Job by the Router's estimate for this deployment
        (None: no Job, e.g. a stats call, or no estimate registered here: ranked without it). Read
        through the imported module, where the Router registered it (`rank_with_prompt_work`)."""
        args = request.args if request is not None else []
        if not args or not isinstance(args[0], Job):
            return None
        estimates = importlib.import_module(type(self).__module__)._PROMPT_WORK
        estimate = estimates.get(_own_scope(self))
        return estimate(args[0]) if estimate is not None else None

    def estimated_loads(self) -> list[ReplicaLoad]:
        """Every running replica's (Serve may route without calling `choose_replicas`, e.g. to one replica)."""
        # (a copy in one C-level call: Serve's router updates the dict from another thread when a replica dies)
        loads = [self._refresh(r) for r in list(self.curr_replicas.values())]
        return [load for load in loads if load is not None]

    def active_streams_by_replica(self) -> dict[str, int]:
        """Active streams of every running replica that reported and is not leaving, by unique id."""
        active = {}
        for replica in list(self.curr_replicas.values()):
            unique_id = replica.replica_id.unique_id
            load = self._refresh(replica)
            if load is not None and unique_id not in self.leaving:
                active[unique_id] = load.num_active
        return active

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        self._ensure_state()
        live = {r.replica_id for r in candidate_replicas}
        self._replicas_seen = {rid: r for rid, r in self._replicas_seen.items() if rid in live}
        live_ids, now_s = {rid.unique_id for rid in live}, self._get_curr_time_s()
        self.leaving &= live_ids
        for unique_id, until_s in list(self.passed_over_until.items()):  # in place: `pass_over` runs elsewhere
            if unique_id not in live_ids or until_s <= now_s:
                self.passed_over_until.pop(unique_id, None)
        key = pending_request.metadata.internal_request_id if pending_request is not None else None
        pinned = _pinned_replica(pending_request, candidate_replicas)
        if pinned is not None:
            self._pinned.add(key)
            return [[pinned]]
        if key is not None and _piece(pending_request) is not None:  # (a turn's first piece: ranked, not counted)
            self._pinned.add(key)
        if key is not None:
            self._choosing.pop(key, None)  # a retry ranks afresh
        work = self._prompt_work(pending_request)  # once per ranking, not per replica
        ranked = sorted(candidate_replicas, key=lambda replica: self._score(replica, work))
        if key is not None and ranked:
            self._choosing[key] = (ranked[0].replica_id, self._get_curr_time_s())
        return [[replica] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._ensure_state()
        key = pending_request.metadata.internal_request_id
        self._choosing.pop(key, None)
        if key not in self._pinned:
            self._events[replica_id].append((self._get_curr_time_s(), 1))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ensure_state()
        if internal_request_id in self._pinned:
            self._pinned.discard(internal_request_id)
            return
        self._events[replica_id].append((self._get_curr_time_s(), -1))


class DetokBoard(PowerOfTwoChoicesRequestRouter):
    """Serve's default routing for the detok handle, kept where `detok_loads` finds it: the LLM
    replica calling the detok replicas reads their reports from it. A decode call naming a live
    replica (`to_replica`: the streams of a stateful detokenizer are pinned) goes there."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        _register(_own_scope(self), self, "_DETOK_BOARDS")

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        wanted = (pending_request.kwargs or {}).get("to_replica") if pending_request is not None else None
        named = next((r for r in candidate_replicas if r.replica_id.unique_id == wanted), None) if wanted else None
        if named is not None:
            return [[named]]
        return await super().choose_replicas(candidate_replicas, pending_request)


def _ask_to_move_out(app_name: str, unique_ids: list[str]) -> None:
    """Ask stopping LLM replicas to hand their streams off (a GCS call: off the router's event loop)."""
    for unique_id in unique_ids:
        try:
            request_move_out(app_name, unique_id)
        except Exception:  # the GCS is going away with the cluster: nothing left to move
            return


def _piece(request: PendingRequest | None) -> TextPiece | MicPiece | None:
    """The call's text piece or microphone turn's piece: a call that starts no stream (not counted as one)."""
    args = request.args if request is not None else []
    return args[0] if args and isinstance(args[0], (TextPiece, MicPiece)) else None


def _pinned_replica(request: PendingRequest | None, candidates: list[RunningReplica]) -> RunningReplica | None:
    """The replica a piece must reach (None: not a piece, a turn's first piece, or that replica is gone;
    then it is routed like any call and the replica it reaches answers that it does not hold it)."""
    piece = _piece(request)
    if piece is None or not piece.llm_replica:
        return None
    unique_id = piece.llm_replica.rsplit("#", 1)[-1]
    return next((r for r in candidates if r.replica_id.unique_id == unique_id), None)

"""Continuous-batching scheduler (pure Python, no torch).

Every step it picks the decode rows and the prompt chunks to prefill under a token budget,
then `update` applies the sampled tokens: append, stop detection, slot release. The engine
calls `schedule` -> runner -> `update`; tests drive it with hand-made token lists.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from cluster.config import CacheConfig, SchedulerConfig
from llm_stage.kv_slots import SlotAllocator
from llm_stage.request import FinishReason, Request, RequestStatus

DecodeOrder = Callable[[list[Request]], list[Request]]


@dataclass(frozen=True)
class PrefillWork:
    """Prompt tokens [start, start + num_tokens) of `req` go into the cache this step."""

    req: Request
    start: int
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.num_tokens >= self.req.prompt_len


@dataclass
class StepPlan:
    decodes: list[Request] = field(default_factory=list)
    prefills: list[PrefillWork] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def sampling_rows(self) -> list[Request]:
        """Requests that get a new token this step, in row order: decodes then finished prefills."""
        return self.decodes + [w.req for w in self.prefills if w.completes_prompt]


def fcfs_order(requests: list[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.arrival_s)


class Scheduler:
    """Owns the waiting / running queues and the KV slots."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        eos_token_ids: Collection[int],
        decode_order: DecodeOrder = fcfs_order,
    ) -> None:
        self.config = config
        self.max_seq_len = cache.max_seq_len
        self.slots = SlotAllocator(cache.num_slots)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode_order = decode_order
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        decoding = [r for r in self.running.values() if r.status is RequestStatus.DECODING]
        plan.decodes = self.decode_order(decoding)[: self.config.max_batch_size]
        budget = self.config.prefill_token_budget
        for req in self._prefill_candidates():
            if budget <= 0 or len(plan.decodes) + len(plan.prefills) >= self.config.max_batch_size:
                break
            if req.status is RequestStatus.WAITING and not self._admit(req):
                break
            num_tokens = min(req.num_prompt_left, budget)
            plan.prefills.append(PrefillWork(req, req.num_cached, num_tokens))
            budget -= num_tokens
        return plan

    def _prefill_candidates(self) -> list[Request]:
        partial = [r for r in self.running.values() if r.status is RequestStatus.PREFILLING]
        return fcfs_order(partial) + list(self.waiting)

    def _admit(self, req: Request) -> bool:
        slot = self.slots.allocate()
        if slot is None:
            return False
        self.waiting.remove(req)
        req.slot = slot
        req.status = RequestStatus.PREFILLING
        self.running[req.req_id] = req
        return True

    def update(self, plan: StepPlan, sampled: list[int]) -> list[Request]:
        """Apply one step's sampled tokens (one per `plan.sampling_rows`); return finished requests."""
        for work in plan.prefills:
            work.req.num_cached += work.num_tokens
            if work.completes_prompt:
                work.req.status = RequestStatus.DECODING
        for req in plan.decodes:
            req.num_cached += 1
        finished = []
        for req, token in zip(plan.sampling_rows, sampled, strict=True):
            if self._append(req, token):
                finished.append(req)
        return finished

    def _append(self, req: Request, token: int) -> bool:
        if token in self.eos_token_ids:
            self._finish(req, FinishReason.STOP, RequestStatus.FINISHED)
            return True
        req.output_ids.append(token)
        out_of_room = req.num_cached >= self.max_seq_len
        if len(req.output_ids) >= req.sampling.max_tokens or out_of_room:
            self._finish(req, FinishReason.LENGTH, RequestStatus.FINISHED)
            return True
        return False

    def cancel(self, req_id: str) -> Request | None:
        req = self.running.get(req_id) or next((r for r in self.waiting if r.req_id == req_id), None)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, FinishReason.CANCELLED, RequestStatus.CANCELLED)
        return req

    def _finish(self, req: Request, reason: FinishReason, status: RequestStatus) -> None:
        req.status = status
        req.finish_reason = reason
        self.running.pop(req.req_id, None)
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None

"""Continuous-batching scheduler (pure Python, no torch).

Every step it picks the decode rows and the prompt chunks to prefill under a token budget,
then `update` applies the sampled tokens: append, stop detection, slot release. A guided
(CFG) request and its hidden unconditional twin form one unit: admitted, prefilled, decoded
(adjacent rows), preempted, cancelled and finished together, each row on its own KV slot.
A streaming-text request whose next position reads text that has not arrived keeps its slot
but gets no batch row (prefill or decode) until the text comes. The adapter may record a sampled
token as more than one position (`record_rule`): the request then prefills them.
The engine calls `schedule` -> runner -> `update`; tests drive it with hand-made tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from core.config import CacheConfig, SchedulerConfig
from core.errors import InvalidArgumentError
from core.policy import PolicyKind, SchedulingPolicy, fcfs_order
from llm_stage.kept_prompts import KeptPrompts
from llm_stage.kv_blocks import BlockAllocator
from llm_stage.kv_slots import SlotAllocator
from llm_stage.request import FinishReason, Request, RequestStatus, Token

StopRule = Callable[[Request, Token], bool]
RecordRule = Callable[[Request, Token], None]  # a sampled token that did not stop its request: record it


def append_output(req: Request, token: Token) -> None:
    """The default record: the token is every row's next output and next position."""
    for row in req.unit:
        row.output_ids.append(token)


@dataclass(frozen=True)
class PrefillWork:
    """Known tokens [start, start + num_tokens) of `req` go into the cache this step."""

    req: Request
    start: int
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.num_tokens >= self.req.num_known


@dataclass
class StepPlan:
    decodes: list[Request] = field(default_factory=list)
    prefills: list[PrefillWork] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def sampling_rows(self) -> list[Request]:
        """Rows that get logits this step, in row order: decodes then finished prefills (twins included)."""
        return self.decodes + [w.req for w in self.prefills if w.completes_prompt]

    @property
    def sampled_requests(self) -> list[Request]:
        """The rows a token is sampled for: `sampling_rows` without the hidden CFG twins."""
        return [r for r in self.sampling_rows if not r.is_twin]


def unit_prefill_sizes(req: Request, budget: int) -> list[int]:
    """Tokens to prefill this step for each row of `req.unit`; a pair completes its prompts together.

    Each row holds back its last prompt token until both fit in this step, so the pair starts
    decoding in the same step (adjacent rows). When only the two held-back tokens remain they
    go in even past the budget, so a budget of 1 cannot stall a pair.
    """
    if req.twin is None:
        return [min(req.num_prompt_left, budget)]
    lefts = [r.num_prompt_left for r in req.unit]
    if sum(lefts) <= budget or lefts == [1, 1]:
        return lefts
    first = min(lefts[0] - 1, budget)
    return [first, min(lefts[1] - 1, budget - first)]


class Scheduler:
    """Owns the waiting / running queues and the KV slots. Twins are never listed on their own.

    The batch order and head-phase alignment come from `policy` (FCFS with no head cycle by
    default); the scheduler fills rows and the token budget in that order.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        eos_token_ids: Collection[int],
        policy: SchedulingPolicy | None = None,
        stop_rule: StopRule | None = None,
        record_rule: RecordRule | None = None,
    ) -> None:
        self.config = config
        self.policy = policy or SchedulingPolicy(PolicyKind.FCFS)
        self.max_seq_len = cache.max_seq_len
        self.slots = SlotAllocator(cache.num_slots)
        self.blocks = (  # the paged layout's block accounting (None: each slot owns a whole row)
            BlockAllocator(cache.total_blocks, cache.block_size, cache.max_blocks_per_slot)
            if cache.layout == "paged"
            else None
        )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_rule = stop_rule or (lambda _req, token: token in self.eos_token_ids)
        self.record_rule = record_rule or append_output
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        self.kept = KeptPrompts()  # ended requests' prompt KV, still in their slots (paged: their prompt's blocks)

    def kv_streams(self, rows_per_stream: int, positions_per_stream: int) -> int:
        """Streams the KV cache can hold at once: by slots, and (paged) by blocks: the running units'
        plus what the free blocks reserve for streams of `positions_per_stream` positions a row."""
        by_slots = self.slots.num_slots // rows_per_stream
        if self.blocks is None:
            return by_slots
        per_stream = self.blocks.row_blocks(positions_per_stream) * rows_per_stream
        free = self.blocks.num_free + sum(len(self.blocks.blocks_of(slot)) for slot in list(self.kept.by_slot))
        return min(by_slots, len(self.running) + free // per_stream)  # (kept prompts' blocks come back on demand)

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything (requests waiting only for streamed text do not count)."""
        return any(not r.is_waiting_for_text for r in self.waiting) or any(
            not r.is_waiting_for_text for r in self.running.values()
        )

    @property
    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_for_text(self) -> int:
        """Requests idle until their client sends more text (running ones hold their KV slots)."""
        return sum(r.is_waiting_for_text for r in [*self.waiting, *self.running.values()])

    def add(self, req: Request) -> None:
        if req.is_twin:
            raise ValueError("a CFG twin is scheduled through its guided request")
        self.waiting.append(req)

    def add_decoding(self, req: Request) -> bool:
        """Run a request whose known positions are already in the cache (a migrated stream): slots
        (and blocks) for its unit now, straight to decoding; False (nothing changed) when they are not free."""
        if req.is_twin or not self._take_kv(req):
            return False
        for row in req.unit:
            row.status = RequestStatus.DECODING
        self.running[req.req_id] = req
        return True

    def positions_reserved(self, row: Request) -> int:
        """Positions a row's blocks are reserved for at admission: every one it can reach, prompt +
        max_tokens (the last sampled token is never written), or the whole context when its positions
        are not one per output token (streamed text, laid-out positions)."""
        if row.text_feed is not None or row.positions is not None:
            return self.max_seq_len
        return min(self.max_seq_len, row.prompt_len + row.sampling.max_tokens)

    def blocks_needed(self, req: Request) -> int:
        """Blocks the unit reserves at admission (0 in the slot layout)."""
        if self.blocks is None:
            return 0
        return sum(self.blocks.row_blocks(self.positions_reserved(row)) for row in req.unit)

    def check_reservable(self, req: Request) -> None:
        """Paged layout: a unit that needs more blocks than the whole pool would wait forever; refuse it."""
        if self.blocks is not None and self.blocks_needed(req) > self.blocks.num_blocks:
            raise InvalidArgumentError(
                "sampling.max_tokens",
                f"needs {self.blocks_needed(req)} KV blocks; the cache holds {self.blocks.num_blocks}",
            )

    def _take_kv(self, req: Request) -> bool:
        """A slot and (paged) its reserved blocks for every row of the unit, or nothing; kept prompts
        give their slots back, oldest first, when too few are free."""
        while self.kept and not self._kv_free_for(req):
            self._free_kept(self.kept.give_back_oldest())
        if self.slots.num_free < len(req.unit):
            return False
        if self.blocks is not None and self.blocks.num_free < self.blocks_needed(req):
            return False
        for row in req.unit:
            row.slot = self.slots.allocate()
            if self.blocks is not None:
                self.blocks.reserve(row.slot, self.positions_reserved(row))
        return True

    def schedule(self) -> StepPlan:
        """Decode rows in policy order, prefill work for new requests (ahead of the order's tail
        when the policy says so), then more prefill work while rows and token budget last."""
        plan = StepPlan()
        decoding = [
            r for r in self.running.values() if r.status is RequestStatus.DECODING and not r.is_waiting_for_text
        ]
        phases = self.policy.phases
        phases.begin_step(decoding)
        priority = self.policy.decode_priority(decoding, self._prompts_to_prefill())
        self._add_decodes(plan, priority.ahead)
        prefill_rows, budget = 0, self.config.prefill_token_budget
        if priority.new_requests:
            prefill_rows, budget = self._schedule_prefills(plan, 0, budget, priority.new_requests)
        self._add_decodes(plan, priority.rest, prefill_rows)
        free_rows = self.config.max_batch_size - len(plan.decodes) - prefill_rows
        self._add_decodes(plan, phases.in_phase_first(priority.can_wait, plan.decodes, free_rows), prefill_rows)
        self._add_decodes(plan, priority.last, prefill_rows)
        self._schedule_prefills(plan, prefill_rows, budget)
        phases.end_step()
        return plan

    def _add_decodes(self, plan: StepPlan, ordered: list[Request], prefill_rows: int = 0) -> None:
        for req in ordered:
            if len(plan.decodes) + prefill_rows + len(req.unit) <= self.config.max_batch_size:
                plan.decodes.extend(req.unit)

    def _schedule_prefills(
        self, plan: StepPlan, rows: int, budget: int, max_units: int | None = None
    ) -> tuple[int, int]:
        """Prefill work for up to `max_units` more requests (None = no limit), given `rows` batch
        rows already spent on prefills; returns the prefill rows and the token budget after it."""
        planned = {id(w.req) for w in plan.prefills}
        candidates = [r for r in self._prefill_candidates() if id(r) not in planned]
        for req in candidates[:max_units]:
            if budget <= 0 or len(plan.decodes) + rows + len(req.unit) > self.config.max_batch_size:
                break
            reuse = self.kept.match(req.prompt_ids) if self._may_reuse(req) else None
            req.num_cached = reuse[1] if reuse is not None else req.num_cached  # (its prefill starts there)
            sizes = unit_prefill_sizes(req, budget)
            completes = all(r.num_cached + n >= r.num_known for r, n in zip(req.unit, sizes, strict=True))
            if (completes and not self.policy.phases.may_start(req)) or (
                req.status is RequestStatus.WAITING and not self._admit(req, reuse)
            ):
                req.num_cached = 0 if reuse is not None else req.num_cached
                break
            for row, num_tokens in zip(req.unit, sizes, strict=True):
                if num_tokens > 0:
                    plan.prefills.append(PrefillWork(row, row.num_cached, num_tokens))
                    budget -= num_tokens
            rows += len(req.unit)
        return rows, budget

    def _prompts_to_prefill(self) -> list[Request]:
        """The requests the policy's urgency horizon counts as still to prefill, each for the steps its
        prompt has left: every waiting one, and the startups part-way through a chunked prefill (no
        audio sent yet: a playing stream prefilling a few laid-out positions is no startup)."""
        running = list(self.running.values())  # (copies: `positions_to_prefill` reads from another thread)
        partial = [r for r in running if r.status is RequestStatus.PREFILLING and r.first_audio_s is None]
        return fcfs_order(partial) + list(self.waiting)

    def positions_to_prefill(self) -> int:
        """Prompt positions waiting to prefill (every row of `_prompts_to_prefill`'s units): what a request
        arriving now is prefilled after (the replica's load report, from another thread)."""
        return sum(row.num_prompt_left for req in self._prompts_to_prefill() for row in req.unit)

    def _prefill_candidates(self) -> list[Request]:
        partial = [r for r in self.running.values() if r.status is RequestStatus.PREFILLING]
        return [r for r in fcfs_order(partial) + list(self.waiting) if not r.is_waiting_for_text]

    def _take_kept(self, req: Request, slot: int, num_positions: int) -> bool:
        """The kept prompt's slot for `req` (paged: its blocks grown to `req`'s reservation, other kept
        prompts giving theirs back first when short); False (nothing changed) when they do not fit."""
        if self.blocks is not None:
            need = self.blocks.extra_blocks(slot, self.positions_reserved(req))
            others = [s for s in self.kept.by_slot if s != slot]
            while self.blocks.num_free < need and others:
                self._free_kept(self.kept.forget(others.pop(0)))
            if not self.blocks.reserve(slot, self.positions_reserved(req)):
                return False
        req.slot = slot
        self.kept.take(slot, num_positions)
        return True

    def _may_reuse(self, req: Request) -> bool:
        """A waiting request that may take a kept prompt's slot: one row, its prompt ids its content."""
        return req.status is RequestStatus.WAITING and req.keeps_prompt_as is not None and req.twin is None

    def _kv_free_for(self, req: Request) -> bool:
        """Whether the free slots (and, paged, blocks) hold the unit's."""
        blocks_free = self.blocks is None or self.blocks.num_free >= self.blocks_needed(req)
        return self.slots.num_free >= len(req.unit) and blocks_free

    def _admit(self, req: Request, reuse: tuple[int, int] | None = None) -> bool:
        """Give every row of the unit its own KV slot (and its blocks), or admit nothing; `reuse`: the kept
        prompt's slot whose first positions the request's prompt shares (`KeptPrompts.match`)."""
        if reuse is not None:
            if not self._take_kept(req, *reuse):
                return False
        elif not self._take_kv(req):
            return False
        self.waiting.remove(req)
        for row in req.unit:
            row.status = RequestStatus.PREFILLING
        self.running[req.req_id] = req
        return True

    def update(self, plan: StepPlan, sampled: list[Token]) -> list[Request]:
        """Apply one token per `plan.sampled_requests` (a twin gets its guided row's); return finished ones."""
        self.advance(plan)
        return self.append(plan, sampled)

    def advance(self, plan: StepPlan) -> None:
        """The token-independent half of `update`: the plan's positions are now in the cache.

        The async engine calls it while the step's forward runs, then `schedule`s the next step
        before the sampled tokens are known, and `append`s them afterwards.
        """
        for work in plan.prefills:
            work.req.num_cached += work.num_tokens
            if work.completes_prompt:
                work.req.status = RequestStatus.DECODING
        for req in plan.decodes:
            req.num_cached += 1

    def retreat(self, plan: StepPlan) -> None:
        """Undo `advance` for a step whose forward or sampling failed: its positions are not in the
        cache after all (whatever it wrote there is overwritten when they are computed again), so
        the next plan computes them again and samples the same tokens."""
        for work in plan.prefills:
            work.req.num_cached -= work.num_tokens
            if work.completes_prompt:
                work.req.status = RequestStatus.PREFILLING  # (a prefill's request was PREFILLING before)
        for req in plan.decodes:
            req.num_cached -= 1
        self.give_back_kept()  # a prompt kept meanwhile may miss what this step was to write: keep none

    def append(self, plan: StepPlan, sampled: list[Token]) -> list[Request]:
        """The token half of `update`: append, detect stops and lengths; returns the finished requests."""
        finished = []
        for req, token in zip(plan.sampled_requests, sampled, strict=True):
            if self._append(req, token):
                finished.append(req)
        return finished

    def _append(self, req: Request, token: Token) -> bool:
        if self.stop_rule(req, token):
            self._finish(req, FinishReason.STOP, RequestStatus.FINISHED)
            return True
        self.record_rule(req, token)
        self.positions_laid_out(req)
        out_of_room = any(not self._has_room(row) for row in req.unit)
        if len(req.output_ids) >= req.sampling.max_tokens or out_of_room:
            self._finish(req, FinishReason.LENGTH, RequestStatus.FINISHED)
            return True
        return False

    def _has_room(self, row: Request) -> bool:
        """Whether the row's next input position fits its context (and, paged, its blocks: grown
        here when a family laid out more positions than reserved; out of blocks ends it as LENGTH)."""
        if row.num_known - 1 >= self.max_seq_len:
            return False
        return self.blocks is None or row.slot is None or self.blocks.reserve(row.slot, row.num_known)

    def positions_laid_out(self, req: Request) -> None:
        """A decoding request given more than one position to compute (a family's laid-out positions,
        e.g. streamed text between sampled tokens) prefills them, sampling at the last."""
        if req.status is RequestStatus.DECODING and req.num_known - req.num_cached > 1:
            for row in req.unit:
                row.status = RequestStatus.PREFILLING

    def revalidate(self, plan: StepPlan) -> StepPlan:
        """A plan made one step ahead, minus the rows finished, cancelled or preempted since.

        Rows go or stay with their unit (a CFG twin shares its request's status).
        """
        decodes = [r for r in plan.decodes if r.status is RequestStatus.DECODING and not r.is_waiting_for_text]
        prefills = [
            w for w in plan.prefills if w.req.status is RequestStatus.PREFILLING and w.req.num_cached == w.start
        ]
        return StepPlan(decodes, prefills)

    def _find(self, req_id: str) -> Request | None:
        return self.running.get(req_id) or next((r for r in self.waiting if r.req_id == req_id), None)

    def cancel(self, req_id: str) -> Request | None:
        req = self._find(req_id)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, FinishReason.CANCELLED, RequestStatus.CANCELLED)
        return req

    def preempt(self, req_id: str) -> bool:
        """Free the unit's slots and requeue it at the front; its known tokens are re-prefilled later."""
        req = self.running.pop(req_id, None)
        if req is None:
            return False
        for row in req.unit:
            self._free_slot(row)
            row.num_cached = 0
            row.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.insert(0, req)
        return True

    def _finish(self, req: Request, reason: FinishReason, status: RequestStatus) -> None:
        self.running.pop(req.req_id, None)
        if self._keeps_prompt(req):  # its slot (and the prompt's blocks) stays allocated, holding the prompt's KV
            self.kept.keep(req.slot, req.prompt_ids, req.keeps_prompt_as)  # type: ignore[arg-type]
            if self.blocks is not None:
                self.blocks.truncate(req.slot, req.prompt_len)  # type: ignore[arg-type]
            req.slot = None
        for row in req.unit:
            row.status = status
            row.finish_reason = reason
            self._free_slot(row)

    def give_back_kept(self) -> None:
        """Free every kept prompt's slot."""
        while self.kept:
            self._free_kept(self.kept.give_back_oldest())

    def _free_kept(self, slot: int) -> None:
        if self.blocks is not None:
            self.blocks.release(slot)
        self.slots.free(slot)

    def _keeps_prompt(self, req: Request) -> bool:
        """Whether an ending request's prompt KV stays for a later request: a whole prompt in a slot (no
        twin, no streamed text, no laid-out positions) of a family that reuses it."""
        return (
            req.keeps_prompt_as is not None and req.slot is not None and req.twin is None
            and req.text_feed is None and req.positions is None and req.num_cached >= req.prompt_len
        )  # fmt: skip

    def _free_slot(self, row: Request) -> None:
        if row.slot is not None:
            if self.blocks is not None:
                self.blocks.release(row.slot)
            self.slots.free(row.slot)
            row.slot = None

"""LLM engine: continuous batching over one LM adapter, usable in-process without Ray.

`add_request` validates and queues; each `step` is schedule -> run -> sample -> update and
returns the new tokens and completed codec frames per request; `cancel` frees the KV slot.
The LLMStage deployment and the in-process pipeline drive it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pydantic
import torch

from cluster.config import CacheConfig, SchedulerConfig
from cluster.errors import InvalidArgumentError, from_validation_error
from cluster.types import SamplingParams
from llm_stage.models.base import FrameBuilder, LMAdapter
from llm_stage.request import FinishReason, Request
from llm_stage.runner import ModelRunner
from llm_stage.sampler import SamplingRow, sample
from llm_stage.scheduler import DecodeOrder, Scheduler, fcfs_order


@dataclass
class StepOutput:
    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_frames: list[list[int]] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None


def resolve_sampling(sampling: SamplingParams | dict | None, default: SamplingParams) -> SamplingParams:
    """Merge a partial dict over the model default; bad values raise naming `sampling.<field>`."""
    if isinstance(sampling, SamplingParams):
        return sampling
    try:
        return default.model_copy(update={}) if not sampling else SamplingParams(**{**default.model_dump(), **sampling})
    except pydantic.ValidationError as err:
        raise from_validation_error(err, "sampling") from None
    except TypeError as err:
        raise InvalidArgumentError("sampling", str(err)) from None


class LLMEngine:
    def __init__(
        self,
        adapter: LMAdapter,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        seed: int = 0,
        decode_order: DecodeOrder = fcfs_order,
    ) -> None:
        self.adapter = adapter
        self.cache_config = cache
        self.scheduler = Scheduler(scheduler, cache, adapter.eos_token_ids, decode_order)
        self.runner = ModelRunner(adapter.backbone, cache.num_slots, cache.max_seq_len)
        self._generator = torch.Generator().manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}
        self._frames: dict[str, FrameBuilder] = {}
        self.requests: dict[str, Request] = {}

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(
        self, req_id: str, text: str, voice: str | None = None, sampling: SamplingParams | dict | None = None
    ) -> Request:
        params = resolve_sampling(sampling, self.adapter.default_sampling)
        return self.add_prompt(req_id, self.adapter.encode_prompt(text, voice), params)

    def add_prompt(self, req_id: str, prompt_ids: list[int], sampling: SamplingParams) -> Request:
        if not req_id or req_id in self.requests:
            raise InvalidArgumentError("request_id", f"{req_id!r} is empty or already in use")
        if len(prompt_ids) >= self.cache_config.max_seq_len:
            raise InvalidArgumentError(
                "text", f"prompt is {len(prompt_ids)} tokens; the context holds {self.cache_config.max_seq_len}"
            )
        req = Request(req_id, list(prompt_ids), sampling)
        if sampling.seed is not None:
            self._seeded[req_id] = torch.Generator().manual_seed(sampling.seed)
        self._frames[req_id] = self.adapter.new_frame_builder()
        self.requests[req_id] = req
        self.scheduler.add(req)
        return req

    def cancel(self, req_id: str) -> bool:
        req = self.scheduler.cancel(req_id)
        self._forget(req_id)
        return req is not None

    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        rows = plan.sampling_rows
        sampled: list[int] = []
        if rows or plan.prefills:
            hidden = self.runner.execute(plan)
            if rows:
                sampled = self._sample(hidden, rows)
        finished = {r.req_id for r in self.scheduler.update(plan, sampled)}
        outputs = [self._output(req, token, req.req_id in finished) for req, token in zip(rows, sampled, strict=True)]
        for req_id in finished:
            self._forget(req_id)
        return outputs

    def _sample(self, hidden: torch.Tensor, rows: list[Request]) -> list[int]:
        logits, cand_ids = self.adapter.logits(hidden, rows)
        sampling_rows = [
            SamplingRow(r.sampling, r.history(r.sampling.repetition_window), self._seeded.get(r.req_id)) for r in rows
        ]
        return sample(logits, cand_ids, sampling_rows, self._generator)

    def _output(self, req: Request, token: int, is_finished: bool) -> StepOutput:
        out = StepOutput(req.req_id, finished=is_finished, finish_reason=req.finish_reason if is_finished else None)
        if token not in self.adapter.eos_token_ids:
            out.new_token_ids.append(token)
            out.new_frames = self._frames[req.req_id].push(token)
        return out

    def _forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self._seeded.pop(req_id, None)
        self._frames.pop(req_id, None)

    def run_to_completion(self) -> dict[str, list[int]]:
        """Step until idle; returns every finished request's generated tokens (for tests and tools)."""
        tokens: dict[str, list[int]] = {}
        while self.has_work:
            for out in self.step():
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        return tokens

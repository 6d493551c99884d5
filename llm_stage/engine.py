"""LLM engine: continuous batching over one LM adapter, usable in-process without Ray.

`add_request` validates and queues; each `step` is schedule -> run -> sample -> update and
returns the new tokens and completed codec frames per request; `cancel` frees the KV slot.
A step samples one id or K codebook ids per row; a request with `guidance_scale` runs with a
hidden unconditional twin whose logits are merged in (CFG). A streaming-text job (native text
streaming) gets later text pieces through `push_text` while it runs. A step that fails leaves the
scheduler as before it; one out of accelerator memory drops the requests it sheds and raises
`StepOutOfMemory` naming them (`llm_stage.faults`). The LLMStage deployment and the in-process
pipeline drive it.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from core.config import CacheConfig, SchedulerConfig
from core.errors import InvalidArgumentError
from core.graphs import default_capture_sizes, graphs_available
from core.messages import Job, ResumeState, SamplingParams
from core.policy import SchedulingPolicy, StepTimer, make_policy
from llm_stage.cfg import merge_guidance
from llm_stage.draws import draw_counter
from llm_stage.faults import StepOutOfMemory, is_out_of_memory, release_cached_memory, requests_to_shed
from llm_stage.histories import incremental_histories
from llm_stage.jobs import build_job
from llm_stage.migration import KVSnapshot, fits, put_rows, take_rows
from llm_stage.models.base import FrameBuilder, LMAdapter
from llm_stage.prefill_pace import PrefillPace
from llm_stage.prompt_work import next_turn_key
from llm_stage.request import FinishReason, Request, RequestStatus, Token
from llm_stage.runner import ModelRunner
from llm_stage.sampler import RowTable, SamplingRow, sample
from llm_stage.scheduler import Scheduler, StepPlan
from llm_stage.step_draws import StepDraws, capture_inner_loop, inner_graph_sizes
from llm_stage.text_feed import TextFeed


@dataclass
class StepOutput:
    """One request's result of one step; `new_token_ids` holds the step's id(s) (K for codebook models)."""

    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_frames: list[list[int]] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None


FOLDED_PROMPT_ROWS = 512  # rows past max_batch_size the derived graph sizes keep for folded prompt tokens


def decode_graph_sizes(scheduler: SchedulerConfig, device: torch.device) -> tuple[int, ...]:
    """The decode batch sizes to capture: the configured ones (off CUDA the runner then says it
    runs eagerly), else on CUDA sizes derived from `max_batch_size` plus the prompt tokens a step
    folds in (up to 512 of `prefill_token_budget`); none with `cuda_graphs` off."""
    if not scheduler.cuda_graphs:
        return ()
    if scheduler.cuda_graph_batch_sizes:
        return scheduler.cuda_graph_batch_sizes
    if not graphs_available(device):
        return ()
    return default_capture_sizes(scheduler.max_batch_size + min(scheduler.prefill_token_budget, FOLDED_PROMPT_ROWS))


class LLMEngine:
    def __init__(
        self,
        adapter: LMAdapter,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        seed: int = 0,
        chain_frames_on_device: bool | None = None,
    ) -> None:
        """`chain_frames_on_device`: whether a frame's inner loop (CSM, Qwen3-TTS) draws on the device and
        reads the frame back once; None = on an accelerator (CPU logits sample faster in numpy)."""
        self.adapter = adapter
        self.cache_config = cache
        self.timer = StepTimer(steps_per_frame=adapter.steps_per_frame)
        self.prefill_pace = PrefillPace()  # prompt positions and audio encoded per second (admission)
        self.policy: SchedulingPolicy = make_policy(scheduler, self.timer, adapter.head_phase_period)
        self.scheduler = Scheduler(
            scheduler, cache, adapter.eos_token_ids, self.policy, adapter.is_stop, adapter.record_token
        )
        # an ended request's prompt KV stays in its slot for the conversation's next turn (`kept_prompts`)
        self.keeps_prompts = cache.keep_prompts and adapter.reuses_prompt_kv
        graph_sizes = decode_graph_sizes(scheduler, adapter.backbone.lm_head_weight.device)
        self.runner = ModelRunner(adapter, cache, graph_sizes, self.scheduler.blocks)
        self._forward_thread = ThreadPoolExecutor(1, "llm-forward") if scheduler.async_steps else None
        self._next_plan: StepPlan | None = None  # async: planned while the previous forward ran
        self._prepared_rows: dict[tuple[int, int], SamplingRow] = {}
        # async steps on an accelerator: the sampled rows' RowTable, built and sent during the forward
        self._prepared_table: tuple[list[tuple[int, int]], RowTable] | None = None
        self.prepares_row_tables = self.runner.device.type != "cpu"  # (CPU logits sample in numpy)
        self._seed_source = random.Random(seed)  # seeds of unseeded requests
        self._seeds: dict[str, int] = {}  # every request's draws are keyed by (seed, draw counter)
        self._vocab_size = adapter.backbone.lm_head_weight.shape[0]
        self._histories = incremental_histories(adapter)
        self._frames: dict[str, FrameBuilder] = {}
        chains = self.prepares_row_tables if chain_frames_on_device is None else chain_frames_on_device
        inner_sizes = inner_graph_sizes(graph_sizes, scheduler.max_batch_size)
        self.draws = StepDraws(self._draw, self._sampling_row, self._vocab_size, chains, inner_sizes)
        capture_inner_loop(adapter, inner_sizes if chains else ())
        self.requests: dict[str, Request] = {}
        self.last_batch_size = 0
        self.last_step_prefilled = False  # the last step ran prompt work beside its decodes

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(
        self, req_id: str, text: str, voice: str | None = None, sampling: SamplingParams | dict | None = None
    ) -> Request:
        """Validate raw fields into a Job (as an ingress does) and queue it."""
        return self.add_job(self.job(req_id, text, voice, sampling))

    def job(
        self, req_id: str, text: str, voice: str | None = None, sampling: SamplingParams | dict | None = None
    ) -> Job:
        """A Job for this engine's model from raw in-process fields (`build_job`), under the caller's id."""
        job = build_job(self.adapter, text=text, voice=voice, sampling=sampling)
        return dataclasses.replace(job, req_id=req_id)  # an empty or duplicate id is refused by add_prompt

    def add_job(self, job: Job, kv: KVSnapshot | None = None) -> Request:
        """Queue a validated Job; the tokenized prompt must fit the KV context (errors name `job.text_field`)."""
        try:
            if job.text_streaming:
                return self._add_streaming(job)
            prompt = self._job_prompt(job)
            guided = job.sampling.guidance_scale is not None
            uncond = self.adapter.unconditional_job_prompt(job) if guided else None
            req = self.add_prompt(job.req_id, prompt, job.sampling, uncond, job.resume, kv)
            if self.keeps_prompts and job.resume is None and not guided:
                req.keeps_prompt_as = next_turn_key(job)
            return req
        except InvalidArgumentError as err:
            if job.req_id not in self.requests:
                self.adapter.forget(job.req_id)  # what its prompt queued (e.g. a clip to encode)
            if err.field != "text":
                raise
            raise InvalidArgumentError(job.text_field, err.message) from None

    def _add_streaming(self, job: Job) -> Request:
        """A native text-streaming job: its prompt reads the first piece, later positions the feed."""
        if job.sampling.guidance_scale is not None:
            raise InvalidArgumentError("sampling.guidance_scale", "is not supported with streamed text")
        if job.resume is not None and not self.adapter.resumes_streamed_text:
            raise InvalidArgumentError(
                "text_streaming", f"{self.adapter.family} streamed-text requests cannot be resumed"
            )
        prompt, feed = self.adapter.streaming_prompt(job)
        for piece in job.resume.text_pieces if job.resume is not None else ():
            self._feed(feed, piece.text, piece.flush, piece.end)  # the text the lost replica had got
        req = self.add_prompt(job.req_id, prompt, job.sampling, resume=job.resume, text_feed=feed)
        self.adapter.text_arrived(req)
        return req

    def push_text(self, req_id: str, text: str = "", flush: bool = False, end: bool = False) -> bool:
        """More text for a running streaming-text request: a piece, a flush of the text held back for
        the tokenizer, or the end of its text. False: no such request here (finished or cancelled)."""
        req = self.requests.get(req_id)
        if req is None or req.is_done:
            return False
        if req.text_feed is None:
            raise InvalidArgumentError("text", f"request {req_id!r} does not stream its text")
        self._feed(req.text_feed, text, flush, end)
        self.adapter.text_arrived(req)
        self.scheduler.positions_laid_out(req)
        return True

    def _feed(self, feed: TextFeed, text: str, flush: bool, end: bool) -> None:
        if feed.is_ended and (text or not end):
            raise InvalidArgumentError("text", "the request's text has already ended")
        if feed.num_chars + len(text) > self.adapter.max_text_chars:
            raise InvalidArgumentError("text", f"the streamed text passes the limit of {self.adapter.max_text_chars}")
        if text:
            feed.push(text)
        if end:
            feed.end()
        elif flush:
            feed.flush()

    def add_prompt(
        self,
        req_id: str,
        prompt_ids: list[Token],
        sampling: SamplingParams,
        uncond_prompt: list[Token] | None = None,
        resume: ResumeState | None = None,
        kv: KVSnapshot | None = None,
        text_feed: TextFeed | None = None,
    ) -> Request:
        """Queue a formatted prompt; a guided request (CFG) passes its twin's `uncond_prompt`, a
        streaming-text one the `text_feed` its later positions read.
        `resume` continues a stream another replica started (see `_restore`), decoding at once from
        its migrated `kv` when that fits and slots are free, else prefilled again."""
        if not req_id or req_id in self.requests:
            raise InvalidArgumentError("request_id", f"{req_id!r} is empty or already in use")
        resumed = len(resume.tokens) if resume is not None else 0
        self._check_fits(prompt_ids, uncond_prompt, sampling, resumed)
        req = Request(req_id, list(prompt_ids), sampling, text_feed=text_feed)
        if uncond_prompt is not None:
            req.twin = Request(f"{req_id}#uncond", list(uncond_prompt), sampling, req.arrival_s, is_twin=True)
        self.scheduler.check_reservable(req)
        self._seeds[req_id] = sampling.seed if sampling.seed is not None else self._seed_source.getrandbits(63)
        self._frames[req_id] = self.adapter.new_frame_builder()
        if resume is not None:
            self._restore(req, resume)
        self.requests[req_id] = req
        if not (kv is not None and self._place_kv(req, kv)):
            self.scheduler.add(req)
        return req

    def _place_kv(self, req: Request, kv: KVSnapshot) -> bool:
        cache = self.runner.cache
        if not (self.adapter.backbone.state_is_slot_kv and fits(kv, req.unit, cache)):
            return False
        if not self.scheduler.add_decoding(req):
            return False
        self.runner.sync_blocks()  # (paged) the rows' blocks, where `put_rows` writes
        put_rows(cache, req.unit, kv)
        return True

    def export_kv(self, req_id: str) -> KVSnapshot | None:
        """A decoding request's KV rows, for another engine to continue it (None: it is not decoding,
        or this backbone keeps state beside the cache; the other engine then prefills it again)."""
        req = self.requests.get(req_id)
        if req is None or req.status is not RequestStatus.DECODING or not self.adapter.backbone.state_is_slot_kv:
            return None
        return take_rows(self.runner.cache, req.unit)

    def _restore(self, req: Request, resume: ResumeState) -> None:
        """The stream's sampled tokens become known positions (prefilled with the prompt, as after a
        preemption, so the next token is sampled from the same context) and its CFG twin follows
        them; a seeded stream's next draws are keyed by its seed and how many it drew, so they
        continue as they would have on the lost replica."""
        for row in req.unit:
            row.output_ids = list(resume.tokens)

    def replay_frames(self, req_id: str) -> list[list[int]]:
        """The codec frames of a resumed request's restored tokens (once, right after it is added)."""
        req, builder = self.requests[req_id], self._frames[req_id]
        return [frame for token in req.output_ids for frame in builder.push(token)]

    def _check_fits(
        self, prompt: list[Token], uncond: list[Token] | None, sampling: SamplingParams, num_resumed: int = 0
    ) -> None:
        longest = max(len(prompt), len(uncond or [])) + num_resumed
        if longest >= self.cache_config.max_seq_len:
            raise InvalidArgumentError(
                "text", f"prompt is {longest} tokens; the context holds {self.cache_config.max_seq_len}"
            )
        if (uncond is None) != (sampling.guidance_scale is None):
            raise InvalidArgumentError("sampling.guidance_scale", "a guided request needs an unconditional prompt")
        if uncond is not None and min(self.cache_config.num_slots, self.scheduler.config.max_batch_size) < 2:
            raise InvalidArgumentError("sampling.guidance_scale", "CFG needs 2 KV slots and batch rows per request")

    def cancel(self, req_id: str) -> bool:
        req = self.scheduler.cancel(req_id)
        self._forget(req_id)
        return req is not None

    def step(self) -> list[StepOutput]:
        """One step. With `async_steps` the forward runs on a worker thread while this thread marks the
        plan's positions cached, selects the next step's batch and builds this step's sampling rows."""
        start = time.perf_counter()
        self._prepared_rows.clear()  # keyed by request identity: never carry them past a failed step
        self._prepared_table = None
        encode_s = self._prepare_step()
        plan = self._take_plan()
        if plan.is_empty:
            return []
        self.last_batch_size = len(plan.decodes) + len(plan.prefills)
        self.last_step_prefilled = bool(plan.prefills)
        is_sync = self._forward_thread is None
        try:  # on any failure the scheduler is as before this step
            sampled = self._compute(plan) if is_sync else self._compute_ahead(plan)
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            raise self._shed(plan, err) from err
        outputs = self._finish(plan, sampled, self.scheduler.update if is_sync else self.scheduler.append)
        decode_rows = 0 if plan.prefills else len(plan.decodes)  # the per-size table is of decode-only steps
        elapsed_s = time.perf_counter() - start
        self.timer.record_step(elapsed_s, decode_rows)
        self.prefill_pace.record_prefill(sum(w.num_tokens for w in plan.prefills), elapsed_s - encode_s)
        return outputs

    def _job_prompt(self, job: Job) -> list[Token]:
        """`job`'s prompt; the audio whose front end ran here for it (`LMAdapter.front_end_seconds`) is
        timed per second (`prefill_pace`)."""
        start = time.perf_counter()
        prompt = self.adapter.job_prompt(job)
        audio_s = self.adapter.front_end_seconds(job)
        if audio_s > 0:
            self.prefill_pace.record_front_end(audio_s, time.perf_counter() - start)
        return prompt

    def _prepare_step(self) -> float:
        """The adapter's batched preprocessing (e.g. the audio encoder over every clip added since the
        last step), timed per second of audio it encoded (`prefill_pace`); returns its seconds."""
        audio_s, start = self.adapter.pending_audio_s, time.perf_counter()
        self.adapter.prepare_step()
        encode_s = time.perf_counter() - start
        self.prefill_pace.record_encode(audio_s, encode_s)
        return encode_s

    def _compute(self, plan: StepPlan) -> list[Token]:
        """Forward and sample `plan` (the request state is read, never changed: a failure leaves it as it was)."""
        hidden = self.runner.forward(self.runner.prepare(plan))
        rows = plan.sampling_rows
        return self._sample(hidden, rows) if rows else []

    def _compute_ahead(self, plan: StepPlan) -> list[Token]:
        """`_compute` with the forward on the worker thread while this one marks the plan's positions
        cached, plans the next step and builds the sampling rows. If anything fails, the forward is
        waited for (it may still be writing the cache), the plan made ahead is dropped and the
        positions are marked uncached again: the scheduler is as it was before this step."""
        pending = self._forward_thread.submit(self.runner.forward, self.runner.prepare(plan))
        self.scheduler.advance(plan)
        try:
            self._next_plan = self.scheduler.schedule()
            self._prepare_sampling_rows(plan.sampled_requests)
            hidden = pending.result()
            rows = plan.sampling_rows
            return self._sample(hidden, rows) if rows else []
        except BaseException:
            futures.wait([pending])
            self._next_plan = None
            self.scheduler.retreat(plan)
            raise

    def _shed(self, plan: StepPlan, err: Exception) -> StepOutOfMemory:
        """After `plan` ran out of memory (rolled back): drop the requests it fails
        (`faults.requests_to_shed`), free the allocator's cached blocks, and say which they were.
        The rest are as before the step: the next step computes their positions again, and since
        draws are keyed by (seed, draw counter) they sample the tokens this one would have."""
        victims = requests_to_shed(plan, list(self.requests.values()))
        for req in victims:
            self.cancel(req.req_id)
        release_cached_memory()
        return StepOutOfMemory([req.req_id for req in victims], err)

    def _take_plan(self) -> StepPlan:
        """The plan made during the previous forward (minus rows finished since), else a fresh one."""
        plan, self._next_plan = self._next_plan, None
        if plan is not None:
            plan = self.scheduler.revalidate(plan)
        return plan if plan is not None and not plan.is_empty else self.scheduler.schedule()

    def _finish(
        self, plan: StepPlan, sampled: list[Token], apply: Callable[[StepPlan, list[Token]], list[Request]]
    ) -> list[StepOutput]:
        visible = plan.sampled_requests  # read before `apply` appends tokens
        finished = {r.req_id for r in apply(plan, sampled)}
        outputs = [self._output(req, tok, req.req_id in finished) for req, tok in zip(visible, sampled, strict=True)]
        for req_id in finished:
            self._forget(req_id)
        return outputs

    def close(self) -> None:
        if self._forward_thread is not None:
            self._forward_thread.shutdown(wait=True)

    @torch.inference_mode()
    def _sample(self, hidden: torch.Tensor, rows: list[Request]) -> list[Token]:
        """Logits of every row -> CFG merge (twins dropped) -> the adapter's sampling rules -> tokens."""
        logits, cand_ids = self.adapter.logits(hidden, rows)
        logits, cand_ids = merge_guidance(logits, cand_ids, rows, self.adapter.guidance)
        visible = [i for i, r in enumerate(rows) if not r.is_twin]
        reqs = [rows[i] for i in visible]
        if len(visible) < len(rows):  # (an index list copies to the device: only when twins are dropped)
            hidden = hidden[visible]
        return self.adapter.sample_tokens(hidden, logits, cand_ids, reqs, self.draws)

    def _draw(
        self, logits: torch.Tensor, cand_ids: torch.Tensor | None, reqs: list[Request], codebooks: list[int]
    ) -> list[int]:
        rows = [self._sampling_row(r, k) for r, k in zip(reqs, codebooks, strict=True)]
        prepared, self._prepared_table = self._prepared_table, None  # one draw uses it, on its own rows
        table = None
        if prepared is not None and prepared[0] == [(id(r), k) for r, k in zip(reqs, codebooks, strict=True)]:
            table = prepared[1]
        return sample(logits, cand_ids, rows, self._vocab_size, table)

    def _prepare_sampling_rows(self, reqs: list[Request]) -> None:
        """Build the rows' sampling inputs ahead of the logits (histories only change at `append`);
        on an accelerator also their RowTable, sent while the forward runs (the draw uses it when
        it draws these rows in this order: one codebook-major draw per step, the usual case)."""
        codebooks = range(self.adapter.num_codebooks)
        for req in reqs:
            for codebook in codebooks:
                self._prepared_rows[(id(req), codebook)] = self._sampling_row(req, codebook)
        if not self.prepares_row_tables or not reqs or any(r.sampling.is_repetition_aware for r in reqs):
            return
        if self.adapter.inner_loop is not None and self.draws.chains_on_device(reqs):
            return  # the frame draws on the device (`StepDraws`), not from a codebook-major table
        keys = [(id(r), k) for r in reqs for k in codebooks]
        rows = [self._prepared_rows[key] for key in keys]
        self._prepared_table = (keys, RowTable.of(rows, 0, self.runner.device))

    def _sampling_row(self, req: Request, codebook: int) -> SamplingRow:
        prepared = self._prepared_rows.get((id(req), codebook))
        if prepared is not None:
            return prepared
        params = req.sampling
        history: Sequence[int] = []
        if params.repetition_penalty != 1.0:
            window = params.repetition_window
            if self._histories is not None:
                history = self._histories.window(req, window)
            else:
                history = self.adapter.penalty_history(req, codebook)
        recent: list[int] = []
        if params.is_repetition_aware:
            recent = self.adapter.drawn_ids(req, codebook)[-params.ras_window :]
        counter = draw_counter(len(req.output_ids), codebook)
        return SamplingRow(params, history, self._seeds[req.req_id], counter, recent)

    def _output(self, req: Request, token: Token, is_finished: bool) -> StepOutput:
        out = StepOutput(req.req_id, finished=is_finished, finish_reason=req.finish_reason if is_finished else None)
        if req.finish_reason is not FinishReason.STOP and self.adapter.is_output(req, token):
            out.new_token_ids.extend([token] if isinstance(token, int) else token)
            out.new_frames = self._frames[req.req_id].push(token)
        return out

    def _forget(self, req_id: str) -> None:
        self.adapter.forget(req_id)
        self.requests.pop(req_id, None)
        self._seeds.pop(req_id, None)
        if self._histories is not None:
            self._histories.forget(req_id)
        self._frames.pop(req_id, None)

    def run_to_completion(self) -> dict[str, list[int]]:
        """Step until idle; returns every finished request's generated tokens (for tests and tools)."""
        tokens: dict[str, list[int]] = {}
        while self.has_work:
            for out in self.step():
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        return tokens

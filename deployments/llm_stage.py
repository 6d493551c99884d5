"""LLMStage deployment: one LLM engine per replica (one accelerator), streaming token chunks.

`generate(job)` answers with one head event (Admitted / Queued / Rejected / Invalid) and queues
the job in the engine. After every engine step, the chunks it cut (of all streams) go to a
DetokStage replica in one `decode_batch` call; each stream then yields, in seq order, an
AudioReady event carrying the chunk's `AudioRef`: duration and frames for this replica's
playback clock, and a handle the router fetches the audio from. Audio never passes through
this replica. A decode call whose detok replica dies is resent (chunks are self-describing).
Cancelling a stream frees its KV slot and drops its undecoded chunks. A streaming-text job gets its
later text through `push_text` (the Router's request router pins those calls to this replica).
Asked to leave, it hands every stream (KV included) to the other replicas; asked to rebalance
(`router.rebalance`), the few cheapest to move. A step out of accelerator memory fails only the
streams it shed (`llm_stage.faults`), each with a Failed event the Router answers RESOURCE_EXHAUSTED
with a retry hint; a lost device ends the replica (`EngineLoop`), whose streams resume elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError

from core.autoscaling import LLM_PREDICTED_TTFA_S, LLM_STREAM_USE
from core.config import CHECK_FILES, ServeConfig
from core.errors import InvalidArgumentError
from core.messages import (
    Admitted,
    AudioReady,
    AudioRef,
    Checkpoint,
    Failed,
    Invalid,
    Job,
    MicPiece,
    MicTokens,
    Moved,
    Queued,
    Rejected,
    StreamEvent,
    TextDelta,
    TextPiece,
    TokenChunk,
)
from core.voices import is_voice_id
from deployments.engine_loop import EngineLoop, finish_on_thread, replica_tag
from deployments.kv_courier import KVMoves
from deployments.loop_trace import StepReport, watch_gc
from deployments.metrics import StageMetrics
from deployments.voices import LLMVoices, prompt_default_voice
from llm_stage.faults import StepOutOfMemory, is_out_of_memory, release_cached_memory
from llm_stage.mic_turns import MicTurns
from llm_stage.migration import KVSnapshot
from llm_stage.prompt_work import PromptWork, prompt_work
from llm_stage.registry import check_model_config
from llm_stage.warm_up import warm_up
from llm_stage.wiring import build_llm_side, size_for_streams
from router.admission import (
    STARTUP_CHUNKS,
    Admission,
    ReplicaLoad,
    StartTimes,
    decide,
    has_room,
    predict_ttfa_s,
    start_to_first_output_s,
    stream_limit,
)
from router.detok_load import step_s_at, summarize_detok
from router.detok_pins import DetokPins
from router.dispatch import detok_loads, handle_scope, live_detok_replicas
from router.drain import announce_llm_replica, is_move_out_requested, publish_moving_out
from router.rebalance import take_rebalance_request
from router.replica_listener import keep_replica_listener_on_loopback
from router.replies import out_of_memory_message

# A decode call whose detok replica died is resent, backing off, for this long: long enough for
# Serve to replace the only replica of a small deployment (10-17 s measured on 2 cores).
DETOK_RETRY_WINDOW_S = 30.0
DETOK_RETRY_BACKOFF_S = (0.05, 0.2, 0.5, 1.0)
MOVE_OUT_POLL_S = 0.2
# A queued stream held by the replica looks for room when a stream ends, finishes starting or
# leaves the queue, and at least this often (the pace figures change without an event)
HOLD_RECHECK_S = 0.25
DETOK_LISTING_S = 5.0  # longest wait for the detok handle's router to list the detok replicas
TYPICAL_PROMPT_TOKENS = 64  # a new stream's prompt, for the paged cache's KV cap (`kv_streams`)
MIC_TURNS_PER_STREAM = 2  # turns being spoken a replica tokenizes at once, per stream it runs (users talk, then listen)

logger = logging.getLogger("ray.serve.voxray")


@dataclass
class _Batch:
    """One step's chunks, shared by the streams they belong to, and the decode call carrying them."""

    chunks: list[TokenChunk]
    num_waiting: int  # streams still waiting for a chunk of this batch
    to_replica: str = ""  # the detok replica its streams are pinned to ("" = the handle's router picks)
    response: object = None  # the current DeploymentResponse (a retry replaces it)
    result: asyncio.Future | None = None  # -> list[AudioRef], index-aligned with `chunks`

    def release(self) -> None:
        """A stream gave up on this batch; the last one cancels the call (its chunks are dropped)."""
        self.num_waiting -= 1
        if self.num_waiting == 0 and not self.result.done():
            if self.response is not None:  # None: the call was not sent yet, and now never will be
                self.response.cancel()
            self.result.cancel()  # Serve ends it with RequestCancelledError: consumed, not logged unobserved
            self.result.add_done_callback(lambda task: task.cancelled() or task.exception())


@dataclass
class _Stream:
    queue: asyncio.Queue  # (batch, index, checkpoint) per chunk in seq order, or the exception that ended the engine
    started_s: float = field(default_factory=time.monotonic)
    arrived_s: float = field(default_factory=time.monotonic)
    is_new: bool = True  # not resumed or moved in: its start times stand for a new stream's (StartTimes)
    pending: list[_Batch] = field(default_factory=list)  # a batch per chunk queued, not yet yielded
    is_done: bool = False
    is_held: bool = False  # queued in the replica, not in the engine yet (`_hold`)
    is_text_only: bool = False  # speech in, a text-only answer: its final TextDelta ends it (no chunks)
    num_chunks: int = 0  # chunks sent
    has_text: bool = False  # some of its answer's text was sent

    @property
    def is_starting(self) -> bool:
        """Running, and fewer than STARTUP_CHUNKS chunks sent (router.admission); a text-only answer,
        which sends no chunk, until its first text was sent (its prefill is behind it then)."""
        if self.is_text_only:
            return not self.is_held and not self.has_text
        return not self.is_held and self.num_chunks < STARTUP_CHUNKS


class LLMStage:
    def __init__(self, config: dict, detok_handle) -> None:
        keep_replica_listener_on_loopback()
        self.config = ServeConfig.model_validate(config, context={CHECK_FILES: False})  # TLS files: the Router's
        entry = check_model_config(self.config.engine.model)
        engine_cfg = size_for_streams(self.config.engine, entry, self.config.admission.max_streams_per_replica)
        self.rows_per_stream = entry.rows_per_stream
        self.side = build_llm_side(engine_cfg)
        self.schedule = self.side.schedule
        self.detok = detok_handle
        self.detok_scope = handle_scope(detok_handle, self.config.app_name)  # its detok replicas' reports
        self.replica_tag = replica_tag()
        self.metrics = StageMetrics(with_kv=True)
        self.streams: dict[str, _Stream] = {}
        self.held: list[_Stream] = []  # queued streams not in the engine yet, first come first (`_hold`)
        self.room_changed: asyncio.Event | None = None  # set (and replaced) when room may have come
        self.event_loop: asyncio.AbstractEventLoop | None = None  # the replica's, set by the first call
        self.avg_stream_s = 0.0
        self.start_times = StartTimes()  # from a stream's start to its first chunks
        self.num_decode_calls = 0
        self.num_audio_refs = 0
        self.voices = LLMVoices(self.config, detok_handle.voice_bank.remote)  # registered voices' LM prompts, read once
        prompt_default_voice(self.config, self.side.engine.adapter)  # `voices.default_clip_text` (cosyvoice2's LM)
        self.num_detok_retries = 0
        # a stateful detokenizer keeps each stream's decoder state on one detok replica: pin them
        self.detok_pins = DetokPins() if entry.family.codec.is_stateful else None
        self.num_moved_out = 0
        self.num_rebalanced_out = 0  # streams handed off to rebalance (this replica stays)
        self.is_moving_out = False  # set once asked to hand every stream to the other replicas
        self.kv_moves = KVMoves(self.config, self.replica_tag)  # KV of streams moved out and in
        self.num_out_of_memory = 0  # streams failed because the accelerator ran out of memory
        self.warm_up_s: float | None = None  # the start-up warm-up's time (None: off or out of memory)
        self.mic_turns = MicTurns(  # streamed turns tokenized here as they come (GLM-4-Voice)
            self.side.engine.adapter, max_turns=MIC_TURNS_PER_STREAM * self.config.admission.max_streams_per_replica,
            idle_s=2 * self.config.incremental.idle_timeout_s,
        )  # fmt: skip
        self.loop = EngineLoop(
            self._step, lambda: self.side.engine.has_work, self._on_step_error, "llm-engine",
            on_idle=self._publish_gauges, on_start=self._warm_up,
        )  # fmt: skip
        self.loop.start()
        watch_gc()
        threading.Thread(target=self._watch_move_out, name="llm-move-out", daemon=True).start()
        if self.detok_pins is not None:
            threading.Thread(target=self._list_detok_replicas, name="llm-detok-list", daemon=True).start()
        threading.Thread(target=self._warm_up_kv_moves, name="llm-kv-courier", daemon=True).start()

    def _warm_up(self) -> None:
        """(Engine thread, before serving) the engine at its largest shapes (`llm_stage.warm_up`),
        unless `engine.warm_up` is off. Out of memory there is logged with what to lower, and the
        replica serves: a step that does not fit sheds what made it bigger (`llm_stage.faults`)."""
        if not self.config.engine.warm_up:
            return
        try:
            self.warm_up_s = warm_up(self.side.engine).seconds
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            release_cached_memory()
            logger.warning(
                "LLM warm-up at the largest shapes ran out of memory (%s): streams beyond what fits will be "
                "shed; lower scheduler.max_batch_size or admission.max_streams_per_replica", err,
            )  # fmt: skip

    def _warm_up_kv_moves(self) -> None:
        try:
            self.kv_moves.warm_up()
        except Exception:  # the courier is not up yet: the first move here forms the pair
            pass

    def _list_detok_replicas(self) -> None:
        """One call through the detok handle at start, so its router lists the detok replicas
        before the first stream's first chunk: a stream's chunks are pinned from its first one
        (sent unpinned, the first could land on another replica than the rest)."""
        try:
            self.detok.stats.remote().result(timeout_s=120)
        except Exception:  # the detok deployment is not up yet: the first chunks go unpinned
            pass

    # ---- engine thread -------------------------------------------------------------------
    def _step(self) -> StepReport:
        """One engine step and its chunks handed to the event loop; the rows it ran (the loop's trace)."""
        chunks = self.side.step()
        # speech in: the answer's text (a final delta, even empty, ends a text-only stream)
        text = [delta for delta in self.side.take_text() if delta.text or delta.is_final]
        if text and self.event_loop is not None:  # queued before the step's chunks: text leads their audio
            self.event_loop.call_soon_threadsafe(self._send_text, text)
        if chunks and self.event_loop is not None:
            self.event_loop.call_soon_threadsafe(self._send, chunks, self.side.take_checkpoints())
        self.metrics.batch_size.observe(self.side.engine.last_batch_size)
        self._publish_gauges()
        engine = self.side.engine
        return StepReport(engine.last_batch_size, not engine.last_step_prefilled)

    def _publish_gauges(self) -> None:
        """The stage's gauges as they are now: after every engine step, and whenever a stream leaves
        this replica (it ended, was cancelled, moved or handed off by a drain), after which no step may
        follow (a last step's reading stayed on the dashboard while the replica sat idle)."""
        scheduler = self.side.engine.scheduler
        self.metrics.queue_depth.set(len(scheduler.waiting))
        self.metrics.active.set(len(self.streams))
        self.metrics.kv_used.set(scheduler.slots.num_used)

    def _on_step_error(self, err: BaseException) -> None:
        """A failed engine step (on the engine thread): one out of memory has dropped the requests it
        shed (`StepOutOfMemory`), whose streams fail, and the rest run on; anything else fails every
        stream here (the engine's state for them is unknown), and the replica serves new ones."""
        if isinstance(err, StepOutOfMemory):
            for req_id in err.req_ids:
                self.num_out_of_memory += req_id in self.streams
                if self.event_loop is not None:
                    self.event_loop.call_soon_threadsafe(self._fail_stream, req_id, err)
            return
        self._fail_all(err)

    def _fail_all(self, err: BaseException) -> None:
        for req_id in list(self.streams):
            self.side.cancel(req_id)
            if self.event_loop is not None:
                self.event_loop.call_soon_threadsafe(self._fail_stream, req_id, err)

    # ---- event loop: chunks out, audio refs back ------------------------------------------
    def _send_text(self, deltas: list[TextDelta]) -> None:
        """The answer's text to its streams, in order with their chunks (a delta waits only for the
        audio of chunks cut before it)."""
        for delta in deltas:
            stream = self.streams.get(delta.req_id)
            if stream is not None:
                stream.queue.put_nowait(delta)

    def _send(self, chunks: list[TokenChunk], checkpoints: dict[tuple[str, int], Checkpoint]) -> None:
        """One decode call for one engine step's chunks; each stream queues its share in seq order
        (with the sampler checkpoint taken at the cut, for the router)."""
        live = [chunk for chunk in chunks if chunk.req_id in self.streams]
        if not live:
            return
        if self.detok_pins is None:
            self._send_batch(live, "", checkpoints)
            return
        for to_replica, pinned in self.detok_pins.split(live, live_detok_replicas(self.detok_scope)).items():
            self._send_batch(pinned, to_replica, checkpoints)

    def _send_batch(
        self, live: list[TokenChunk], to_replica: str, checkpoints: dict[tuple[str, int], Checkpoint]
    ) -> None:
        batch = _Batch(live, len({c.req_id for c in live}), to_replica)
        batch.result = asyncio.ensure_future(self._decoded(batch))
        for index, chunk in enumerate(live):
            stream = self.streams[chunk.req_id]
            stream.pending.append(batch)
            stream.queue.put_nowait((batch, index, checkpoints.get((chunk.req_id, chunk.seq))))

    async def _decoded(self, batch: _Batch) -> list[AudioRef]:
        """Decode `batch`'s chunks; a detok replica lost mid-call costs a resend to another one
        (chunks are self-describing, so any replica decodes them to the same audio)."""
        give_up_s = time.monotonic() + DETOK_RETRY_WINDOW_S
        for attempt in itertools.count():
            batch.response = self.detok.decode_batch.remote(batch.chunks, to_replica=batch.to_replica)
            self.num_decode_calls += 1
            sent_s = time.perf_counter()
            try:
                refs = await batch.response
            except (RayActorError, ActorUnavailableError):
                if time.monotonic() >= give_up_s:
                    raise
                self.num_detok_retries += 1
                await asyncio.sleep(DETOK_RETRY_BACKOFF_S[min(attempt, len(DETOK_RETRY_BACKOFF_S) - 1)])
                continue
            self.side.engine.timer.record_detok(time.perf_counter() - sent_s)
            self._follow_decoder_state(batch.to_replica, refs)
            return refs

    def _follow_decoder_state(self, to_replica: str, refs: list[AudioRef]) -> None:
        """A stream whose chunk was sent to its pinned detok replica but decoded on another (its own
        was gone) is pinned there from now on: its decoder state is rebuilt there. (A call sent
        unpinned, before the handle listed the replicas, pins only streams not pinned since.)"""
        if self.detok_pins is None:
            return
        for ref in refs:
            decoded_on = ref.detok_replica.rsplit("#", 1)[-1]
            if ref.is_final or ref.req_id not in self.streams or decoded_on == to_replica:
                continue
            if to_replica or ref.req_id not in self.detok_pins.by_stream:
                self.detok_pins.decoded_on(ref.req_id, decoded_on)

    def _fail_stream(self, req_id: str, err: BaseException) -> None:
        stream = self.streams.get(req_id)
        if stream is not None:
            stream.queue.put_nowait(err)

    # ---- moving streams out (a replica about to leave, or rebalancing) ----------------------
    def _watch_move_out(self) -> None:
        """Say which node this replica runs on, then poll for requests: hand a few streams to the
        other replicas when asked to rebalance (`router.rebalance`); once asked to leave, hand off
        every stream here, publishing how many are left."""
        app, replica = self.config.app_name, self.replica_tag.split("#")[-1]
        try:
            announce_llm_replica(app, replica, ray.get_runtime_context().get_node_id())
        except Exception:  # outside Serve (no replica context) or the GCS is away: no node move-out here
            pass
        while not self.is_moving_out:
            time.sleep(MOVE_OUT_POLL_S)
            try:
                self.is_moving_out = is_move_out_requested(app, replica)
                num_to_move = 0 if self.is_moving_out else take_rebalance_request(app, replica)
            except Exception:  # the GCS is going away with the cluster
                continue
            if num_to_move:
                self._move_streams_out(limit=num_to_move, is_leaving=False)
        while True:
            self._move_streams_out()
            try:
                publish_moving_out(app, replica, len(self.streams))
            except Exception:
                pass
            time.sleep(MOVE_OUT_POLL_S)

    def _move_streams_out(self, limit: int | None = None, is_leaving: bool = True) -> None:
        """Stop running streams between two engine steps (every one, or the `limit` cheapest to move)
        and send each a Moved event (after the chunks already cut) carrying its state and KV, put in
        the object store."""
        if self.event_loop is None:
            return
        with self.loop.exclusive():
            req_ids = list(self.streams) if limit is None else self._movable_streams(limit)
            moved = [(req_id, self.side.move_out(req_id)) for req_id in req_ids]
        for req_id, taken in moved:
            if taken is None:  # not in the engine yet (still being added), finished, or streaming its text
                continue
            state, kv = taken
            parcel = self.kv_moves.parcel(req_id, kv) if kv is not None else None
            detok_replica = self.detok_pins.by_stream.get(req_id, "") if self.detok_pins is not None else ""
            resume = dataclasses.replace(state, kv=parcel, detok_replica=detok_replica)
            if is_leaving:
                self.num_moved_out += 1
            else:
                self.num_rebalanced_out += 1
            moved_event = Moved(resume, self.replica_tag, is_leaving)
            self.event_loop.call_soon_threadsafe(self._queue_moved, req_id, moved_event)

    def _movable_streams(self, limit: int) -> list[str]:
        """Up to `limit` streams to rebalance, fewest generated tokens first (the least KV to ship).
        A streaming-text request stays (its text pieces come to this replica). Under `exclusive`."""
        requests, chunkers = self.side.engine.requests, self.side.chunkers  # a finished stream has no chunker
        running = [req_id for req_id in list(self.streams) if req_id in requests and req_id in chunkers]
        movable = [req_id for req_id in running if requests[req_id].text_feed is None]
        return sorted(movable, key=lambda req_id: len(requests[req_id].output_ids))[:limit]

    def _queue_moved(self, req_id: str, moved: Moved) -> None:
        stream = self.streams.get(req_id)
        if stream is not None:
            stream.queue.put_nowait(moved)

    async def _fetch_kv(self, job: Job) -> KVSnapshot | None:
        """A moved stream's KV rows (None: none sent, or lost with the replica that sent them)."""
        if job.resume is None or job.resume.kv is None:
            return None
        return await self.kv_moves.receive(job.resume.kv)

    # ---- replica API ----------------------------------------------------------------------
    def kv_streams(self, rows_per_stream: int) -> int:
        """Streams the KV cache holds at once (a CFG twin holds a slot and blocks too): by slots and,
        paged, by free blocks, a new stream counted at the family's default max_tokens + a prompt."""
        engine = self.side.engine
        positions = engine.adapter.default_sampling.max_tokens + TYPICAL_PROMPT_TOKENS
        return engine.scheduler.kv_streams(rows_per_stream, positions)

    def load(self) -> ReplicaLoad:
        admission = self.config.admission
        first_tokens = self.schedule.chunk_size(0) + self.schedule.right_context_frames
        timer, rows_per_stream = self.side.engine.timer, self.rows_per_stream
        real_time_rows = timer.measured_real_time_rows() or 0.0
        full = admission.max_streams_per_replica + admission.max_queued_per_replica
        kv_streams = self.kv_streams(rows_per_stream)
        detok = summarize_detok(detok_loads(self.detok_scope))
        num_streams = len(self.streams)
        return ReplicaLoad(
            num_active=full if self.is_moving_out else num_streams,  # routers then send it nothing
            max_streams=max(1, min(admission.max_streams_per_replica, kv_streams)),
            max_queued=admission.max_queued_per_replica,
            step_s=timer.measured_step_s,  # decode steps: not a resume's long prefill; 0 = none measured yet
            first_chunk_tokens=math.ceil(first_tokens * self.side.engine.adapter.steps_per_frame),
            avg_stream_s=self.avg_stream_s,
            real_time_streams=real_time_rows / rows_per_stream,
            measured_streams=max(timer.step_s_by_rows, default=0) // rows_per_stream,
            real_time_margin=admission.real_time_margin,
            num_starving=self.side.num_starving(),
            reported_unix_s=time.time(),
            next_step_s=step_s_at(timer.step_s_by_rows, (num_streams + 1) * rows_per_stream) or 0.0,
            detok_real_time_streams=detok.real_time_streams,
            detok_other_streams=max(0, detok.num_streams - num_streams),
            detok_first_chunk_s=detok.first_chunk_s,
            predicts=admission.policy == "predictive",
            num_starting=sum(stream.is_starting for stream in self.streams.values()),
            startup_limit=admission.max_starting_per_replica,
            startup_s=self.start_times.startup_s(),
            measured_first_chunk_s=self.start_times.first_chunk_s(),
            measured_ttfa_s=self.start_times.ttfa_s(),
            credible_ttfa_factor=admission.credible_ttfa_factor,
            ends_in_s=self._ends_in_s(detok.first_chunk_s),
            starting_for_s=self._starting_for_s(),
            prefill_tokens_per_s=self.side.engine.prefill_pace.tokens_per_s(timer.measured_step_s),
            queued_prefill_positions=self.side.engine.scheduler.positions_to_prefill(),
            kept_prompt_keys=self.side.engine.scheduler.kept.keys(),
            encoder_s_per_audio_s=self.side.engine.prefill_pace.encoder_s_per_audio_s(),
            front_end_s_per_audio_s=self.side.engine.prefill_pace.front_end_s_per_audio_s(),
            prefill_token_budget=self.side.engine.scheduler.config.prefill_token_budget,
            default_voice_positions=self.side.engine.adapter.voice_prompt_positions(None),
        )

    def _starting_for_s(self) -> tuple[float, ...]:
        """How long each starting stream has been starting, longest first (router.admission)."""
        now = time.monotonic()
        return tuple(sorted((now - s.started_s for s in list(self.streams.values()) if s.is_starting), reverse=True))

    def _ends_in_s(self, decode_s: float) -> tuple[float, ...]:
        """The most each running stream has left, soonest first: its steps to its max_tokens at the
        step measured now and its last chunk's decode (`decode_s`); one finished in the engine
        waits for its last decodes only; one not in the engine yet takes a mean lifetime."""
        step_s, ends = self.side.engine.timer.steady_step_s, []
        for req_id, stream in list(self.streams.items()):
            if stream.is_held:
                continue
            steps = self.side.steps_left(req_id)
            if steps is not None:
                ends.append(steps * step_s + decode_s)
            elif stream.pending or stream.num_chunks:  # its engine part is over
                ends.append(decode_s)
            else:
                ends.append(self.avg_stream_s)
        return tuple(sorted(ends))

    def check_health(self) -> None:
        """Serve's periodic health check: fails once the engine lost its device (`EngineLoop`)."""
        self.loop.check_health()

    def record_routing_stats(self) -> dict:
        return self.load().to_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (`deployments.autoscaling`): one more stream's predicted
        TTFA here, and the share of the streams it admits (KV slots, measured pace) in use."""
        load = self.load()
        return {LLM_PREDICTED_TTFA_S: predict_ttfa_s(load), LLM_STREAM_USE: load.num_active / stream_limit(load)}

    def loop_trace(self, since_s: float = 0.0) -> dict[str, list | float]:
        """The serving loop's steps (rows each) and this process's collections since `since_s`
        (monotonic; `deployments.loop_trace`), tagged with this replica."""
        return {**self.loop.trace.snapshot(since_s), "replica": self.replica_tag}

    def stats(self) -> dict:
        engine = self.side.engine
        return {
            **self.load().to_stats(),
            "engine_requests": len(engine.requests),
            # the serving loop's decode step by batch rows, medians of recent steps (what admission paces by)
            "step_ms_by_rows": {rows: round(1e3 * s, 3) for rows, s in sorted(engine.timer.step_s_by_rows.items())},
            "waiting_for_text": engine.scheduler.num_waiting_for_text,  # streams idle for text (KV held)
            "text_waits": self.side.num_text_waits,  # times a stream had run out of text when more came
            "kv_slots_used": engine.scheduler.slots.num_used,
            "kv_slots_total": engine.scheduler.slots.num_slots,
            "kv_blocks_used": engine.scheduler.blocks.num_used if engine.scheduler.blocks else 0,  # paged layout
            "kv_blocks_total": engine.scheduler.blocks.num_blocks if engine.scheduler.blocks else 0,
            "decode_calls": self.num_decode_calls,  # one per engine step that cut chunks
            "audio_refs": self.num_audio_refs,  # chunks forwarded by reference (their audio never came here)
            "detok_retries": self.num_detok_retries,  # decode calls resent after losing a detok replica
            "out_of_memory": self.num_out_of_memory,  # streams failed because the accelerator ran out of memory
            "warm_up_s": self.warm_up_s,  # the start-up warm-up at the largest shapes (None: off or out of memory)
            # streams placed on each detok replica so far (a stateful detokenizer's are pinned)
            "detok_streams_placed": dict(self.detok_pins.placed) if self.detok_pins is not None else {},
            "moved_out": self.num_moved_out,  # streams handed to other replicas (move-out)
            "rebalanced_out": self.num_rebalanced_out,  # streams handed to other replicas (rebalance)
            "mic_turns_tokenized": self.mic_turns.num_tokenized,  # streamed turns tokenized here as they came
            "mic_turns_open": len(self.mic_turns.turns),
            "kv_slots_kept": len(engine.scheduler.kept),  # ended requests' prompt KV kept for a next turn
            "prompt_reuses": engine.scheduler.kept.num_reuses,  # requests that started on a kept prompt
            "prompt_positions_reused": engine.scheduler.kept.num_reused_positions,
            "kv_moved_in": sum(self.kv_moves.num_in.values()),  # streams that arrived with their KV rows
            **self.kv_moves.stats(),  # kv_moved_in_over (gloo / object_store), kv_bytes_moved_in, fallbacks
            "replica": self.replica_tag,
            "at_s": time.time(),  # wall clock of this reading, for latency bounds measured from outside
        }

    async def generate(self, job: Job) -> AsyncIterator[StreamEvent]:
        """A head event, then Audio events up to the final chunk (or one Failed event)."""
        if job.req_id in self.streams:  # never let a duplicate id touch the running stream's state
            yield Invalid("request_id", f"{job.req_id!r} is already streaming")
            return
        if self.is_moving_out:  # leaving: a resumed stream goes back to the router for another replica
            leaving = Moved(job.resume, self.replica_tag) if job.resume is not None else None
            yield leaving or Rejected(self.config.admission.retry_after_s)
            return
        # A resumed stream, or a later segment of an incremental one, was admitted once already: it
        # queues for a slot rather than being dropped.
        admitted_before = job.resume is not None or job.segment_index > 0
        try:
            if is_voice_id(job.voice):  # looked up first: its prompt is part of the work admission charges
                await self.voices.ensure(job.voice, self.side.engine.adapter)
            load, work = self.load(), self._prompt_work(job)
        except InvalidArgumentError as err:
            yield Invalid(err.field, err.message)
            return
        verdict = Admission.ADMIT if admitted_before else decide(load, job.ttfa_deadline_s, work)
        if verdict is Admission.REJECT:
            logger.debug("admission: %s rejected: predicted TTFA %.2f s vs deadline %.2f s; %s; %s", job.req_id,
                         predict_ttfa_s(load, work=work), job.ttfa_deadline_s, work, load)  # fmt: skip
            yield Rejected(self.config.admission.retry_after_s)
            return
        self.event_loop = asyncio.get_running_loop()
        await self._know_detok_replicas()
        kv = await self._fetch_kv(job)
        if self.detok_pins is not None and job.resume is not None:  # its decoder state stays where it is
            self.detok_pins.decoded_on(job.req_id, job.resume.detok_replica)
        stream = _Stream(asyncio.Queue(), is_new=job.resume is None, is_text_only=job.text_only)
        self.streams[job.req_id] = stream
        try:
            try:
                if verdict is Admission.QUEUE and not await self._hold(stream, self._start_by(job)):
                    yield Rejected(self.config.admission.retry_after_s)  # it would start too late: no head yet
                    return
                await finish_on_thread(self._add, job, kv)  # a cancel mid-add reaches `_close` after it
            except InvalidArgumentError as err:
                yield Invalid(err.field, err.message)
                return
            except torch.OutOfMemoryError:  # placing it (prompt, moved KV) took memory there was not: shed it
                release_cached_memory()
                yield Rejected(self.config.admission.retry_after_s)  # (`_close` drops what it left)
                return
            yield Queued(self.replica_tag) if verdict is Admission.QUEUE else Admitted(self.replica_tag)
            async for event in self._audio(stream):
                yield event
        finally:
            await self._close(job.req_id, stream)

    async def _audio(self, stream: _Stream) -> AsyncIterator[AudioReady | TextDelta | Moved | Failed]:
        """The stream's chunks' AudioRefs in seq order, as their decode calls return."""
        while True:
            item = await stream.queue.get()
            if isinstance(item, BaseException):  # the engine failed: the stream fails, never hangs
                yield self._failed("LLM engine", item)
                return
            if isinstance(item, Moved):  # handed off: the chunks cut here came first
                yield item
                return
            if isinstance(item, TextDelta):
                yield item
                if stream.is_text_only and item.text and not stream.has_text:
                    stream.has_text = True
                    self._wake_held()  # one start less
                if item.is_final and stream.is_text_only:  # a text-only answer ends with its text
                    stream.is_done = True
                    return
                continue
            batch, index, checkpoint = item
            try:
                ref: AudioRef = (await asyncio.shield(batch.result))[index]
            except Exception as err:  # the detok replica failed this batch: the stream ends, typed
                yield self._failed("detokenizer", err)
                return
            stream.pending.remove(batch)
            self.side.mark_audio_sent(ref.req_id, ref.duration_s, ref.num_frames)
            self.num_audio_refs += 1
            self._count_chunk(stream)
            yield AudioReady(ref, checkpoint)
            if ref.is_final:
                stream.is_done = True
                return

    def _failed(self, stage: str, err: BaseException) -> Failed:
        """The Failed event for a stream `stage` failed with `err`: an out-of-memory one says so with
        a retry hint (the Router answers RESOURCE_EXHAUSTED), anything else is INTERNAL there."""
        if is_out_of_memory(err):
            return Failed(out_of_memory_message(self.config.admission.retry_after_s))
        return Failed(f"{stage} failed: {err}")

    def _count_chunk(self, stream: _Stream) -> None:
        stream.num_chunks += 1
        if stream.num_chunks <= STARTUP_CHUNKS and stream.is_new:
            now = time.monotonic()
            self.start_times.record(stream.num_chunks, now - stream.started_s, now - stream.arrived_s)
        if stream.num_chunks == STARTUP_CHUNKS:
            self._wake_held()  # one start less

    async def push_text(self, piece: TextPiece) -> bool | Invalid:
        """More text for a streaming-text job running here: True when taken, False when the stream is
        not here any more (finished or cancelled), or the piece was sent to another replica (one lost
        with the stream, which resumed here with that piece replayed), Invalid when the text cannot
        be taken."""
        if piece.req_id not in self.streams or piece.llm_replica != self.replica_tag:
            return False
        try:
            return await finish_on_thread(self._push_text, piece)
        except InvalidArgumentError as err:
            return Invalid(err.field, err.message)

    async def mic_piece(self, piece: MicPiece) -> MicTokens:
        """A piece of a microphone turn tokenized here as it comes (`llm_stage.mic_turns`); a piece sent to
        another replica (its turn's was lost and the call rerouted) answers that this one does not hold it."""
        if piece.llm_replica and piece.llm_replica != self.replica_tag:
            return MicTokens("")
        return await finish_on_thread(self.mic_turns.take, piece, self.replica_tag)

    def _push_text(self, piece: TextPiece) -> bool:
        with self.loop.exclusive():
            taken = self.side.push_text(piece)
        self.loop.wake()
        return taken

    def _add(self, job: Job, kv: KVSnapshot | None = None) -> None:
        with self.loop.exclusive():
            self.side.add(job, kv)
        self.loop.wake()

    async def _close(self, req_id: str, stream: _Stream) -> None:
        self.streams.pop(req_id, None)
        self._wake_held()
        if self.detok_pins is not None:
            self.detok_pins.forget(req_id)
        lifetime = time.monotonic() - stream.started_s
        if stream.is_done:
            self.avg_stream_s = lifetime if not self.avg_stream_s else 0.8 * self.avg_stream_s + 0.2 * lifetime
        else:
            for batch in {id(b): b for b in stream.pending}.values():
                batch.release()
            await finish_on_thread(self._cancel, req_id)  # never withdrawn by a second cancel
        self._publish_gauges()

    async def _know_detok_replicas(self) -> None:
        """Before a stateful detokenizer's first stream here: wait (up to DETOK_LISTING_S) until the
        detok handle's router lists the detok replicas. Until it does, decode calls go unpinned, and
        a stream's next chunks, cut before its first came back, were placed on another replica than
        the one holding its decoder state (rebuilt there: audible drift in an app's first streams)."""
        if self.detok_pins is None or live_detok_replicas(self.detok_scope):
            return
        self.detok.record_routing_stats.remote()  # (a first call makes the handle's router list them)
        give_up_s = time.monotonic() + DETOK_LISTING_S
        while not live_detok_replicas(self.detok_scope) and time.monotonic() < give_up_s:
            await asyncio.sleep(0.02)

    async def _hold(self, stream: _Stream, start_by_s: float) -> bool:
        """A queued stream waits here, first come first, until the streams running are under the
        limit the measured pace sets (`stream_limit`) and those starting under the startup limit
        (`router.admission.has_room`): True. Not in the engine: its scheduler starts a request as
        soon as a KV slot is free, and the KV cap is above that limit whenever the pace is what
        binds (a burst then ran every queued stream at once, and all of them underran).
        False when no room came by `start_by_s` (monotonic): started later it would miss its TTFA
        deadline, so it is refused instead (queue only what starts in time)."""
        self.held.append(stream)
        stream.is_held = True
        try:
            while not self.is_moving_out and not (self.held[0] is stream and self._has_room()):
                left_s = start_by_s - time.monotonic()
                if left_s <= 0:
                    return False
                await self._room_may_have_come(min(HOLD_RECHECK_S, left_s))
            return True
        finally:
            self.held.remove(stream)
            stream.is_held = False
            stream.started_s = time.monotonic()  # its lifetime in the engine (`avg_stream_s`) starts now
            self._wake_held()  # the next one in the queue is first now

    async def _room_may_have_come(self, timeout_s: float) -> None:
        """Wait until `_wake_held` or `timeout_s`. (Polling every 20 ms, each a whole `load`, cost the
        event loop, and the GIL the engine thread steps with, for every stream held in a burst.)"""
        if self.room_changed is None:
            self.room_changed = asyncio.Event()
        try:
            await asyncio.wait_for(self.room_changed.wait(), timeout_s)
        except TimeoutError:
            pass

    def _wake_held(self) -> None:
        """Room may have come (a stream ended, finished starting, or left the queue): the held
        streams look again (on the event loop)."""
        if self.room_changed is not None:
            self.room_changed.set()
            self.room_changed = None

    def _start_by(self, job: Job) -> float:
        """When a queued job must start to make its TTFA deadline (monotonic): its first chunk takes
        what recent streams' took, its own prompt work at the measured pace included (the prediction
        when none started lately; a text-only answer's first text, the prediction)."""
        first_output_s = start_to_first_output_s(self.load(), self._prompt_work(job))
        return time.monotonic() + max(0.0, job.ttfa_deadline_s - first_output_s)

    def _prompt_work(self, job: Job) -> PromptWork:
        """The prompt work `job` brings here (router.admission charges it at this replica's measured pace):
        its voice's prompt positions included (every voice known here; the Router knows a registered one once
        it looked it up), its CFG twin's prompt too, less its earlier turns when this replica kept their prompt."""
        adapter = self.side.engine.adapter
        work = prompt_work(type(adapter), job, adapter.voice_prompt_positions(job.voice))
        return work.on_replica_keeping(self.side.engine.scheduler.kept.keys())

    def _has_room(self) -> bool:
        running = len(self.streams) - len(self.held)
        return has_room(dataclasses.replace(self.load(), num_active=running))

    def _cancel(self, req_id: str) -> None:
        with self.loop.exclusive():
            self.side.cancel(req_id)

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()

"""LLMStage deployment: one LLM engine per replica (one accelerator), streaming token chunks.

`generate(job)` answers with one head event (Admitted / Queued / Rejected / Invalid), queues
the job in the engine and, for every ready TokenChunk, sends the chunk straight to a DetokStage
replica (tokens never pass through the router) and yields the decoded audio to the router in
seq order as Audio events (or one Failed event). Cancelling the stream frees the KV slot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from core.config import ServeConfig
from core.errors import InvalidArgumentError
from core.messages import Admitted, Audio, Failed, Invalid, Job, Queued, Rejected, StreamEvent, TokenChunk
from deployments.engine_loop import EngineLoop, finish_on_thread, replica_tag
from deployments.metrics import StageMetrics
from llm_stage.registry import check_model_config
from llm_stage.wiring import build_llm_side, size_for_streams
from router.admission import Admission, ReplicaLoad, decide


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    started_s: float = field(default_factory=time.monotonic)
    is_done: bool = False


def _drain(queue: asyncio.Queue) -> list:
    """Responses still queued (not yet awaited) when a stream ends early."""
    items = []
    while not queue.empty():
        response, _ = queue.get_nowait()
        if not isinstance(response, BaseException):
            items.append(response)
    return items


class LLMStage:
    def __init__(self, config: dict, detok_handle) -> None:
        self.config = ServeConfig.model_validate(config)
        entry = check_model_config(self.config.engine.model)
        engine_cfg = size_for_streams(self.config.engine, entry, self.config.admission.max_streams_per_replica)
        self.side = build_llm_side(engine_cfg)
        self.schedule = self.side.schedule
        self.detok = detok_handle
        self.replica_tag = replica_tag()
        self.metrics = StageMetrics(with_kv=True)
        self.streams: dict[str, _Stream] = {}
        self.avg_stream_s = 0.0
        self.loop = EngineLoop(self._step, lambda: self.side.engine.has_work, self._fail_all, "llm-engine")
        self.loop.start()

    # ---- engine thread -------------------------------------------------------------------
    def _step(self) -> None:
        for chunk in self.side.step():
            self._deliver(chunk.req_id, chunk)
        engine = self.side.engine
        self.metrics.batch_size.observe(engine.last_batch_size)
        self.metrics.queue_depth.set(len(engine.scheduler.waiting))
        self.metrics.active.set(len(self.streams))
        self.metrics.kv_used.set(engine.scheduler.slots.num_used)

    def _deliver(self, req_id: str, item: TokenChunk | BaseException) -> None:
        stream = self.streams.get(req_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, err: BaseException) -> None:
        for req_id in list(self.streams):
            self.side.cancel(req_id)
            self._deliver(req_id, err)

    # ---- replica API ----------------------------------------------------------------------
    def load(self) -> ReplicaLoad:
        admission = self.config.admission
        first_tokens = self.schedule.chunk_size(0) + self.schedule.right_context_frames
        return ReplicaLoad(
            num_active=len(self.streams),
            max_streams=admission.max_streams_per_replica,
            max_queued=admission.max_queued_per_replica,
            step_s=self.side.engine.timer.step_s,  # the estimate the policy uses too
            first_chunk_tokens=first_tokens * self.side.engine.adapter.tokens_per_frame,
            avg_stream_s=self.avg_stream_s,
        )

    def record_routing_stats(self) -> dict:
        return self.load().to_stats()

    def stats(self) -> dict:
        engine = self.side.engine
        return {
            **self.load().to_stats(),
            "engine_requests": len(engine.requests),
            "kv_slots_used": engine.scheduler.slots.num_used,
            "kv_slots_total": engine.scheduler.slots.num_slots,
            "at_s": time.time(),  # wall clock of this reading, for latency bounds measured from outside
        }

    async def generate(self, job: Job) -> AsyncIterator[StreamEvent]:
        """A head event, then Audio events up to the final chunk (or one Failed event)."""
        if job.req_id in self.streams:  # never let a duplicate id touch the running stream's state
            yield Invalid("request_id", f"{job.req_id!r} is already streaming")
            return
        verdict = decide(self.load(), job.ttfa_deadline_s)
        if verdict is Admission.REJECT:
            yield Rejected(self.config.admission.retry_after_s)
            return
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        self.streams[job.req_id] = stream
        try:
            try:
                await finish_on_thread(self._add, job)  # a cancel mid-add reaches `_close` after it
            except InvalidArgumentError as err:
                yield Invalid(err.field, err.message)
                return
            yield Queued(self.replica_tag) if verdict is Admission.QUEUE else Admitted(self.replica_tag)
            async for event in self._audio(stream):
                yield event
        finally:
            await self._close(job.req_id, stream)

    async def _audio(self, stream: _Stream) -> AsyncIterator[Audio | Failed]:
        """Send each TokenChunk to a detok replica as soon as it is ready; yield the audio in seq order."""
        decoding: asyncio.Queue = asyncio.Queue()
        sender = asyncio.create_task(self._send_chunks(stream, decoding))
        responses = []
        try:
            while True:
                response, chunk = await decoding.get()
                if isinstance(response, BaseException):
                    yield Failed(f"LLM engine failed: {response}")
                    return
                responses.append(response)
                waited_s = time.perf_counter()
                try:
                    audio = await response
                except Exception as err:  # the detok replica failed this chunk: the stream ends, typed
                    yield Failed(f"detokenizer failed: {err}")
                    return
                self.side.engine.timer.record_detok(time.perf_counter() - waited_s)
                self.side.mark_audio_sent(chunk.req_id, audio.duration_s, audio.num_frames)
                yield Audio(audio)
                if chunk.is_final:
                    stream.is_done = True
                    return
        finally:
            sender.cancel()
            if not stream.is_done:
                for response in responses + _drain(decoding):
                    response.cancel()

    async def _send_chunks(self, stream: _Stream, decoding: asyncio.Queue) -> None:
        while True:
            item = await stream.queue.get()
            if isinstance(item, BaseException):  # the consumer raises it: the stream fails, never hangs
                decoding.put_nowait((item, None))
                return
            decoding.put_nowait((self.detok.decode.remote(item), item))
            if item.is_final:
                return

    def _add(self, job: Job) -> None:
        with self.loop.exclusive():
            self.side.add(job)
        self.loop.wake()

    async def _close(self, req_id: str, stream: _Stream) -> None:
        self.streams.pop(req_id, None)
        lifetime = time.monotonic() - stream.started_s
        if stream.is_done:
            self.avg_stream_s = lifetime if not self.avg_stream_s else 0.8 * self.avg_stream_s + 0.2 * lifetime
        else:
            await finish_on_thread(self._cancel, req_id)  # never withdrawn by a second cancel

    def _cancel(self, req_id: str) -> None:
        with self.loop.exclusive():
            self.side.cancel(req_id)

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()

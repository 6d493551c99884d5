"""DetokStage deployment: one detokenizer engine per replica (one accelerator).

An LLMStage replica calls `decode_batch` once per engine step with every chunk that step cut,
of all its streams; chunks from concurrent calls are decoded together by the engine thread.
The call's audio stays in this replica's object store as one object; the caller gets an
`AudioRef` per chunk (frames, duration, the handle, its index) and the router fetches the object
from here once for all its streams, so audio takes one hop to the ingress and never passes
through the LLM replica. Chunks are self-describing, so any replica can decode any chunk (M:N
routing; a stateful codec's streams are pinned to one replica by their LLM replica, see
`router.detok_pins`, and its engine decodes each stream's chunks in seq order); cancelling a call
drops its chunks. A failed step fails the calls waiting here (out of memory as such, so their
streams' clients get a retry hint); a lost device ends the replica (`EngineLoop`), and its callers
send their chunks to another one.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
import torch

from core.autoscaling import DETOK_BUSY_SHARE, DETOK_MIN_SLACK_S, NO_DEADLINE_SLACK_S
from core.config import CHECK_FILES, ServeConfig
from core.messages import AudioChunk, AudioRef, TokenChunk
from deployments.engine_loop import EngineLoop, finish_on_thread, replica_tag
from deployments.loop_trace import StepReport, watch_gc
from deployments.metrics import StageMetrics
from deployments.voices import DetokVoices, check_voice_encoders, default_clip_voice
from detok_stage.warm_up import warm_up
from llm_stage.faults import is_out_of_memory, release_cached_memory
from llm_stage.registry import check_model_config
from llm_stage.wiring import build_detok_engine
from router.detok_load import DeadlineSlack, DetokPace
from router.replica_listener import keep_replica_listener_on_loopback

logger = logging.getLogger("ray.serve.voxray")

# A cancelled stream's decoder state is kept this long: its LLM replica may have died, and the
# stream resumes on another within seconds (a client's cancel just frees it later).
PARKED_STATE_S = 30.0


class DetokStage:
    def __init__(self, config: dict) -> None:
        keep_replica_listener_on_loopback()
        self.config = ServeConfig.model_validate(config, context={CHECK_FILES: False})  # TLS files: the Router's
        self.engine = build_detok_engine(self.config.engine, in_order=False)
        self.replica_tag = replica_tag()
        self.metrics = StageMetrics(with_kv=False)
        self.waiters: dict[tuple[str, int], asyncio.Future] = {}
        self.num_decoded_chunks = 0
        self.num_decode_calls = 0
        self.pace = DetokPace()  # measured decode steps, reported to the LLM replicas for admission
        self.slack = DeadlineSlack()  # time its decodes left before playback deadlines, for autoscaling
        self.parked: dict[str, float] = {}  # req_id -> when its call was cancelled (decoder state kept)
        self.voices = DetokVoices(self.config, self.replica_tag)  # registered voices' tensors, fetched once
        if check_model_config(self.config.engine.model).family.lm.takes_registered_voices:
            check_voice_encoders(self.config)  # raises for a wrong voices.encoder_dir
            default_voice = default_clip_voice(self.config)
            if default_voice is not None:
                self.engine.codec.set_default_voice(default_voice)
            self.voices.join_soon()
        self.warm_up_s: float | None = None  # the start-up warm-up's time (None: off or out of memory)
        self.loop = EngineLoop(
            self._step, lambda: self.engine.has_work, self._fail_all, "detok-engine", on_idle=self._publish_gauges,
            on_start=self._warm_up,
        )  # fmt: skip
        self.loop.start()
        watch_gc()

    def _warm_up(self) -> None:
        """(Engine thread, before serving) one batch of the longest windows the LLM side cuts
        (`detok_stage.warm_up`), unless `engine.warm_up` is off; out of memory is logged, not fatal."""
        if not self.config.engine.warm_up:
            return
        window = check_model_config(self.config.engine.model).chunk_schedule(self.config.engine).longest_window()
        try:
            self.warm_up_s = warm_up(self.engine, window).seconds
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            release_cached_memory()
            logger.warning("detokenizer warm-up ran out of memory (%s): lower detok.max_batch_chunks", err)

    def _step(self) -> StepReport:
        """One batch decoded and each chunk's waiter resolved; the chunks it decoded (the loop's trace)."""
        started_s = time.perf_counter()
        decoded = self.engine.step()
        elapsed_s = time.perf_counter() - started_s
        ids, finished = [a.req_id for a in decoded], [a.req_id for a in decoded if a.is_final]
        self.pace.record_step(elapsed_s, [a.duration_s for a in decoded], ids, finished)
        for audio in decoded:
            self.num_decoded_chunks += 1
            self._resolve((audio.req_id, audio.seq), audio)
        self.metrics.batch_size.observe(len(decoded))
        self._publish_gauges()
        return StepReport(len(decoded))

    def _publish_gauges(self) -> None:
        """Queued chunks and streams waiting here, after every step and after a drop (cancelled
        streams: no step may follow to publish them)."""
        self.metrics.queue_depth.set(self.engine.num_queued)
        self.metrics.active.set(len({req_id for req_id, _ in list(self.waiters)}))

    def _resolve(self, key: tuple[str, int], value: AudioChunk | BaseException) -> None:
        future = self.waiters.pop(key, None)
        if future is None:
            return
        setter = future.set_exception if isinstance(value, BaseException) else future.set_result
        future.get_loop().call_soon_threadsafe(lambda: None if future.done() else setter(value))

    def _fail_all(self, err: BaseException) -> None:
        """Fail every call waiting here. Out of memory stays a torch OutOfMemoryError through the Ray
        call, so the LLM replica fails its streams as out-of-memory (RESOURCE_EXHAUSTED with a hint)."""
        if is_out_of_memory(err):
            release_cached_memory()
            failure: Exception = torch.OutOfMemoryError(f"detokenizer out of memory: {err}")
        else:
            failure = RuntimeError(f"detokenizer failed: {err}")
        for key in list(self.waiters):
            self._resolve(key, failure)

    async def decode_batch(self, chunks: list[TokenChunk], to_replica: str = "") -> list[AudioRef]:
        """Decode `chunks` (one LLM step's, any streams); each audio stays here behind its ref.
        `to_replica` is read by the caller's request router only (`DetokBoard`: the replica the
        streams are pinned to); a call it could not place there is decoded here all the same."""
        self.num_decode_calls += 1
        handles = {chunk.voice_handle for chunk in chunks if chunk.voice_handle}
        if handles:  # a registered voice this replica lacks comes over the stage transport first
            await self.voices.ensure(handles, self.engine.codec)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in chunks]
        try:
            await finish_on_thread(self._submit, chunks, futures)  # a cancel mid-submit drops after it
            decoded = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            await finish_on_thread(self._drop, {chunk.req_id for chunk in chunks})
            raise
        self.slack.record([chunk.deadline_s for chunk in chunks])
        return self._publish(chunks, decoded)

    def _publish(self, chunks: list[TokenChunk], decoded: list[AudioChunk]) -> list[AudioRef]:
        """The call's audio in ONE object (a put per chunk cost ~1 ms of CPU here and ~0.5 ms in
        the Router per chunk: loadtest.chunk_path_bench); each ref says where its chunk is in it."""
        for audio in decoded:
            audio.detok_replica = self.replica_tag
        handle = ray.put(decoded)
        return [
            AudioRef(a.req_id, a.seq, a.is_final, a.duration_s, a.num_frames, handle, chunk, index, self.replica_tag)
            for index, (chunk, a) in enumerate(zip(chunks, decoded, strict=True))
        ]

    def _submit(self, chunks: list[TokenChunk], futures: list[asyncio.Future]) -> None:
        with self.loop.exclusive():
            for chunk in chunks:
                if not chunk.redo:  # (a redo leaves the stream's state where it is)
                    self.parked.pop(chunk.req_id, None)
                self.engine.submit(chunk)
            for chunk, future in zip(chunks, futures, strict=True):
                self.waiters[(chunk.req_id, chunk.seq)] = future
        self.loop.wake()

    def _drop(self, req_ids: set[str]) -> None:
        """Forget every queued chunk of `req_ids` and cancel the calls still waiting for them. Their
        decoder states are parked for PARKED_STATE_S: a call is cancelled when its LLM replica dies
        too, and the stream then resumes on another one, sending here again the chunks the Router
        never got (a stateful codec decodes them from the state it kept: exact)."""
        now_s = time.monotonic()
        with self.loop.exclusive():
            for req_id in req_ids:
                self.engine.drop_queued(req_id)
                self.parked[req_id] = now_s
            for req_id in [r for r, since_s in self.parked.items() if now_s - since_s > PARKED_STATE_S]:
                self.engine.release(req_id)
                del self.parked[req_id]
            waiting = [self.waiters.pop(k) for k in [k for k in self.waiters if k[0] in req_ids]]
        self.pace.forget(req_ids)  # cancelled streams run here no more
        self._publish_gauges()
        for future in waiting:
            future.get_loop().call_soon_threadsafe(future.cancel)

    def check_health(self) -> None:
        """Serve's periodic health check: fails once the engine lost its device (`EngineLoop`)."""
        self.loop.check_health()

    def record_routing_stats(self) -> dict:
        return self.pace.load(num_queued_chunks=len(self.waiters)).to_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (`deployments.autoscaling`): busy share, deadline slack."""
        slack_s = self.slack.min_slack_s(none_s=NO_DEADLINE_SLACK_S)
        return {DETOK_BUSY_SHARE: self.pace.busy_share(), DETOK_MIN_SLACK_S: slack_s}

    async def voice_stats(self) -> dict:
        """The registered voices this replica fetched and its tensor endpoint's transfer counters."""
        return await self.voices.stats()

    def voice_bank(self):
        """The app's VoiceBank (this stage's deployment actor), for the Router and the LLM replicas."""
        return self.voices.bank_handle()

    def loop_trace(self, since_s: float = 0.0) -> dict[str, list | float]:
        """The serving loop's steps (chunks each) and this process's collections since `since_s`
        (monotonic; `deployments.loop_trace`), tagged with this replica."""
        return {**self.loop.trace.snapshot(since_s), "replica": self.replica_tag}

    def stats(self) -> dict:
        return {
            "queued_chunks": len(self.waiters),
            "engine_requests": self.engine.num_requests,
            "engine_pending": self.engine.has_work,
            "decoded_chunks": self.num_decoded_chunks,
            "decode_calls": self.num_decode_calls,
            "warm_up_s": self.warm_up_s,  # the start-up warm-up of one batch of the longest windows
            "at_s": time.time(),  # wall clock of this reading
        }

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()

"""The transport-independent part of the Router: admission checks, dispatch to an LLM replica,
ordered audio from the detok replicas' object stores, resuming a stream whose LLM replica died
or moved it, the drain, and incremental-text sessions (one streaming-text request fed text pieces
for families that read text while they speak, else a request per text segment), each counted once
in the metrics. `router.ingress` wraps it in the gRPC and HTTP front doors (the Router deployment).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from ray import serve
from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError

from core.config import ServeConfig
from core.errors import InvalidArgumentError
from core.messages import (
    Admitted,
    AudioChunk,
    AudioReady,
    Failed,
    Invalid,
    Job,
    MicPiece,
    MicTokens,
    Moved,
    Queued,
    Rejected,
    ResumeState,
    StreamHead,
    TextDelta,
    TextPiece,
)
from llm_stage.prompt_work import PromptWork, prompt_work
from llm_stage.registry import get_entry
from router.admission import admits_anywhere, predict_ttfa_s, stream_limit
from router.audio_fetch import StepAudio
from router.deadlines import best_predicted_ttfa_s, client_deadline_s, fit_to_client_deadline
from router.dispatch import estimated_loads, handle_scope, num_live_replicas, pass_over, rank_with_prompt_work
from router.drain import DrainWatch
from router.incremental import IncrementalSession, SegmentAudio
from router.jobs import (
    job_from_fields,
)
from router.metrics import RouterMetrics
from router.mic_tokens import ReplicaMicTokens
from router.native_session import NativeTextSession, TextRoute
from router.playback import PlaybackTracker, TextPacedPlayback
from router.rebalance import Rebalancer
from router.resume import StreamProgress
from router.voices import VoiceRegistry


def replica_name() -> str:
    """This Router replica's id (a fixed name outside a Serve replica, e.g. in unit tests)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return "local"


logger = logging.getLogger("ray.serve.voxray")
# A stream whose LLM replica dies is resumed elsewhere at most this many times, after these waits
# (Serve's handle skips a replica once a call to it failed with ActorDiedError).
RESUME_BACKOFF_S = (0.05, 0.2, 0.5)
MAX_MOVES = 8  # hand-offs of one stream by leaving replicas (one bounces resumed streams it is sent)
HEAD_POLL_S = 0.05  # while waiting for a stream's head: how often to look for live LLM replicas


class AdmissionRejected(Exception):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"server at capacity; retry after {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


class ReplicasUnavailable(Exception):
    """Every LLM replica this router knew has died; Serve is starting another."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"no synthesis replica is available; retry after {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


class Draining(Exception):
    """The server is stopping: new streams are refused, and streams past the drain deadline end."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"server is shutting down; retry after {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


class StreamMoved(Exception):
    """The LLM replica handed the stream off; `moved.resume` continues it on another one."""

    def __init__(self, moved: Moved) -> None:
        super().__init__(f"stream moved off {moved.llm_replica}")
        self.moved = moved


class StreamFailed(Exception):
    """The stream broke inside the cluster (a Failed event, or a stream that ended early)."""


@dataclass
class SentChunk:
    """One chunk of audio to the client, or (speech in) the answer's text decoded since the last one:
    `audio` None and `text` set, sent as soon as the LLM replica has it."""

    audio: AudioChunk | None
    seq: int
    ttfa_s: float | None
    elapsed_s: float
    llm_replica: str = ""
    frames: tuple[tuple[int, ...], ...] = ()  # the codec frames the audio covers
    text: str = ""


async def first_event(stream, is_lost: Callable[[], bool], poll_s: float = HEAD_POLL_S):
    """`stream`'s first event, or None once `is_lost()` says no replica is left to serve it. The
    read is its own task; when the caller gives up (a client gone, the replicas lost) the read is
    cancelled and its outcome consumed: Serve turns the cancel into RequestCancelledError, which
    an unobserved task logged as a traceback ("Task exception was never retrieved")."""
    head = asyncio.ensure_future(anext(stream))
    try:
        while True:
            done, _ = await asyncio.wait({head}, timeout=poll_s)
            if done:
                return head.result()
            if is_lost():
                return None
    finally:
        if not head.done():
            head.cancel()
            head.add_done_callback(lambda task: task.cancelled() or task.exception())


class OutageClock:
    """Whether no LLM replica at `scope` (`dispatch.board_scope`) has been left to route to for `wait_s`
    (0: as soon as none is); the clock restarts whenever one is listed again."""

    def __init__(self, scope: str, wait_s: float, req_id: str) -> None:
        self.scope, self.wait_s, self.req_id = scope, wait_s, req_id
        self.since_s: float | None = None

    def is_over(self) -> bool:
        if num_live_replicas(self.scope) != 0:
            self.since_s = None
            return False
        now = time.monotonic()
        if self.since_s is None:
            self.since_s = now
            if self.wait_s > 0:
                logger.warning("%s: no LLM replica left; waiting up to %.0f s for a replacement", self.req_id,
                               self.wait_s)  # fmt: skip
        return now - self.since_s >= self.wait_s


class RouterCore:
    """Transport-independent part of the router: validation, dispatch, ordered streaming."""

    def __init__(self, config: dict, llm_handle, detok_handle, drain: DrainWatch | None = None) -> None:
        """`config`: the served model's view (`ServeConfig.for_model`); `drain`: the Router replica's
        one watch when it serves several models (else this core's own, counting its streams)."""
        self.config = ServeConfig.model_validate(config)
        self.entry = get_entry(self.config.engine.model.name)
        self.llm = llm_handle.options(stream=True)
        self.llm_text = llm_handle  # text pieces of streaming-text requests (pinned to their replica)
        self.llm_scope = handle_scope(llm_handle, self.config.app_name)  # this model's LLM load board
        rank_with_prompt_work(self.llm_scope, self.prompt_work)  # its request router ranks by a Job's own work
        self.voices: VoiceRegistry | None = None  # a registered voice's prompt in `prompt_work` (`use_voices`)
        self.detok = detok_handle  # decodes a chunk again when the replica holding its audio is lost
        self.step_audio = StepAudio()  # one fetch per engine step's audio, shared by its streams
        self.open_streams = 0
        self.metrics = RouterMetrics(self.entry.name)
        self.drain = drain or DrainWatch(self.config.app_name, replica_name(), lambda: self.open_streams)
        self.rebalancer = Rebalancer(  # started by the Router
            self.config.app_name, self.config.rebalance,
            max_streams_per_replica=self.config.admission.max_streams_per_replica, scope=self.llm_scope,
        )  # fmt: skip

    def job(self, **fields) -> Job:
        return job_from_fields(self.entry, self.config.admission, speech_in=self.config.speech_in, **fields)

    async def fit_client_deadline(self, job: Job, grpc_context) -> Job:
        """`job` within the gRPC call's deadline, or DeadlineUnmeetable (router.deadlines); its registered
        voice's prompt looked up first (`learn_voice`), so the prediction counts it."""
        remaining_s = client_deadline_s(grpc_context)
        if remaining_s is None:
            return job
        await self.learn_voice(job)
        predicted_s = best_predicted_ttfa_s(estimated_loads(self.llm_scope), self.prompt_work(job))
        return fit_to_client_deadline(job, remaining_s, predicted_s)

    def use_voices(self, voices: VoiceRegistry) -> None:
        """Count a registered voice's prompt in this Router's estimates, as `voices` learns it."""
        self.voices = voices

    def prompt_work(self, job: Job) -> PromptWork:
        """The prompt work `job` brings (its prompt positions, a registered voice's as far as this Router knows
        them, its audio to encode: the family's figures), charged at each replica's measured prefill pace
        (router.admission). A request naming no voice, or any voice of a family whose voices are alike, gets each
        replica's default voice prompt as the replica reports it (`ReplicaLoad.work_here`)."""
        lm = self.entry.family.lm
        default_voice_here = job.voice is None or lm.voices_alike
        voice_positions = 0
        if not default_voice_here and self.voices is not None:
            voice_positions = self.voices.prompt_positions(job.voice)
        return prompt_work(lm, job, voice_positions, default_voice_here)

    async def learn_voice(self, job: Job) -> None:
        """A registered voice named for the first time here: its prompt looked up before admission estimates."""
        if self.voices is not None:
            await self.voices.learn(job.voice)

    def check_capacity(self, job: Job) -> None:
        """Reject at once when no LLM replica known here would admit `job`, or queue it to start by
        its TTFA deadline (both stages' measured pace, router.admission), or when the streams this
        router has open itself fill every replica (a burst arrives before any stats refresh)."""
        loads = estimated_loads(self.llm_scope)
        if not loads:
            return
        capacity = sum(stream_limit(load) + load.max_queued for load in loads)
        work = self.prompt_work(job)
        if self.open_streams >= capacity or not admits_anywhere(loads, job.ttfa_deadline_s, work):
            self.metrics.rejections.inc()
            predicted = [round(predict_ttfa_s(load, work=work), 2) for load in loads]  # (why: for tuning)
            logger.debug("admission: %s rejected: %d open of %d; predicted TTFA %s s vs deadline %.2f s; limits %s",
                         job.req_id, self.open_streams, capacity, predicted, job.ttfa_deadline_s,
                         [stream_limit(load) for load in loads])  # fmt: skip
            raise AdmissionRejected(self.config.admission.retry_after_s)

    def check_alive(self) -> None:
        """UNAVAILABLE at once when no LLM replica is left to route to (Serve would hold the request
        until it has started another: 10-20 s)."""
        if num_live_replicas(self.llm_scope) == 0:
            raise ReplicasUnavailable(self.config.admission.unavailable_retry_after_s)

    def check_open(self) -> None:
        """UNAVAILABLE while the server drains (a client retries on another one)."""
        if self.drain.is_draining:
            raise Draining(self.config.drain.retry_after_s)

    async def run(self, job: Job) -> AsyncIterator[SentChunk]:
        self.check_open()
        self.check_alive()
        await self.learn_voice(job)
        self.check_capacity(job)
        self.open_streams += 1
        try:
            async for sent in self._dispatch(job):
                yield sent
        finally:
            self.open_streams -= 1

    @asynccontextmanager
    async def incremental(self, template: Job) -> AsyncIterator[IncrementalSession | NativeTextSession]:
        """An incremental-text stream: admitted (and counted as one stream here, in the metrics too)
        for its whole life. A family that reads text while it speaks runs it as one streaming-text
        request; the others run its segments one after another on any LLM replica."""
        self.check_open()
        self.check_alive()
        await self.learn_voice(template)
        self.check_capacity(template)
        self.open_streams += 1
        family, config = self.entry.family, self.config.incremental
        is_draining = lambda: self.drain.is_draining  # noqa: E731
        if family.streams_text:
            session: IncrementalSession | NativeTextSession = NativeTextSession(
                template, family.lm, config, self.text_stream_audio, self.send_text, self.entry.sample_rate_hz,
                is_draining,
            )  # fmt: skip
        else:
            session = IncrementalSession(
                template, family.lm, config, self.segment_audio, self.entry.sample_rate_hz, is_draining=is_draining
            )
        try:
            yield session
        finally:
            self.open_streams -= 1
            if session.is_finished:
                self._record_session(session.playback)

    async def segment_audio(self, job: Job) -> AsyncIterator[SegmentAudio]:
        """One segment of an incremental stream, as its session wants it: audio and frames."""
        async for sent in self._dispatch(job, record=False):
            if sent.audio is not None:  # text-only chunks come from speech-in jobs, never segments
                yield SegmentAudio(sent.audio, sent.frames)

    async def text_stream_audio(self, job: Job, route: TextRoute) -> AsyncIterator[SegmentAudio]:
        """A streaming-text request's audio; `route` points at the LLM replica running it (where its
        pieces go). When that replica dies mid-stream, the request resumes on another from the last
        checkpoint, with the text it was sent replayed (families whose positions read text by index)."""
        tracker, progress = PlaybackTracker(time.monotonic()), StreamProgress()
        resume: ResumeState | None = None
        num_lost = 0
        while True:
            try:  # a resumed request starts like a new stream: its client may have run dry meanwhile
                resumed = dataclasses.replace(job, resume=resume, buffered_audio_s=None) if resume else job
                async for sent in self._relay(resumed, tracker, progress, route.point_at, record=False):
                    if sent.audio is not None:
                        yield SegmentAudio(sent.audio, sent.frames)
                return
            except (RayActorError, ActorUnavailableError) as err:
                if not self.entry.family.lm.resumes_streamed_text:
                    raise
                pieces = route.lose()  # later pieces wait for the replica that resumes it
                await self._back_off_to_resume(job.req_id, err, progress, num_lost)
                num_lost += 1
                resume = dataclasses.replace(progress.resume_state(), text_pieces=pieces)

    def mic_forward(self, sample_rate_hz: int) -> ReplicaMicTokens | None:
        """A streamed turn's forwarding to an LLM replica that tokenizes it as it comes (families whose
        speech tokenizer needs the weights: `tokenizes_mic_audio`); None: the Router's front end serves."""
        if not self.entry.family.lm.tokenizes_mic_audio:
            return None
        return ReplicaMicTokens(self.send_mic_piece, uuid.uuid4().hex, sample_rate_hz)

    async def send_mic_piece(self, piece: MicPiece) -> MicTokens:
        """A turn's piece to the LLM replica tokenizing it (the first one: to the best ranked)."""
        return await self.llm_text.mic_piece.remote(piece)

    async def send_text(self, piece: TextPiece) -> bool | Invalid:
        """False when the piece's replica does not have its stream (any more), or is lost."""
        try:
            return await self.llm_text.push_text.remote(piece)
        except (RayActorError, ActorUnavailableError):
            return False

    def _record_session(self, playback: TextPacedPlayback) -> None:
        for underrun_s in playback.underruns_s:
            self.metrics.underrun.observe(underrun_s)
        self._record_finished(playback, time.monotonic())

    async def _dispatch(self, job: Job, record: bool = True) -> AsyncIterator[SentChunk]:
        """Stream `job` from an LLM replica. When that replica dies mid-stream, resume it on another
        from the last checkpoint the client's chunks carried (`router.resume`); when it hands the
        stream off (a Moved event: it is leaving), continue it elsewhere with the KV it sent."""
        tracker, progress = PlaybackTracker(time.monotonic()), StreamProgress()
        handoff: ResumeState | None = None
        num_lost = num_moved = 0
        while True:
            resume = handoff or (progress.resume_state() if progress.next_seq else None)
            try:
                relayed = self._relay(dataclasses.replace(job, resume=resume), tracker, progress, record=record)
                async for sent in relayed:
                    yield sent
                return
            except StreamMoved as moved:
                num_moved += moved.moved.is_leaving  # a rebalancing replica stays: its moves are bounded by
                if num_moved > MAX_MOVES:  # the Rebalancer's cooldown, not by this count
                    raise StreamFailed(f"moved {num_moved} times without a replica taking it") from None
                handoff = moved.moved.resume
                progress.adopt(handoff)
                self._pass_over(moved.moved)
                self.metrics.moves.inc()
            except (RayActorError, ActorUnavailableError) as err:
                await self._back_off_to_resume(job.req_id, err, progress, num_lost)
                num_lost += 1
                handoff = None  # its KV died with the replica: prefill again from the checkpoints

    async def _back_off_to_resume(self, req_id: str, err: Exception, progress: StreamProgress, num_lost: int) -> None:
        """Wait before resuming a stream whose LLM replica was lost (`num_lost` times so far); raises
        `err` again when it may not resume (lost too often, or a checkpoint was missed)."""
        if num_lost >= len(RESUME_BACKOFF_S) or not progress.is_resumable:
            raise err
        await asyncio.sleep(RESUME_BACKOFF_S[num_lost])
        self.metrics.resumes.inc()
        lost = type(err).__name__
        logger.warning("%s: LLM replica lost (%s); resuming at chunk %d", req_id, lost, progress.next_seq)

    def _pass_over(self, moved: Moved) -> None:
        """Rank the replica that handed the stream off last: for good when it is leaving, for
        `rebalance.pass_over_s` when it rebalanced (so the stream lands on a less busy one)."""
        for_s = None if moved.is_leaving else self.config.rebalance.pass_over_s
        pass_over(self.llm_scope, moved.llm_replica, for_s)

    async def _relay(
        self,
        job: Job,
        tracker: PlaybackTracker,
        progress: StreamProgress,
        on_head: Callable[[str], None] | None = None,
        record: bool = True,
    ) -> AsyncIterator[SentChunk]:
        """One LLM replica's stream of `job`, its audio fetched, in seq order, to the final chunk
        (`on_head` gets the replica's tag; `record`: count it in the metrics as a whole stream)."""
        stream = self.llm.generate.remote(job)
        finished = False
        try:
            llm_replica = self._check_head(await self._head(stream, job.req_id, job.resume is not None))
            if on_head is not None:
                on_head(llm_replica)
            async for event in stream:
                if isinstance(event, Failed):
                    raise StreamFailed(event.message)
                if isinstance(event, Moved):
                    raise StreamMoved(event)
                if isinstance(event, TextDelta):
                    if event.text:
                        yield self._text_sent(event, tracker, progress.next_seq, llm_replica, record)
                    progress.record_text(event)  # (a resumed stream goes on after the text sent)
                    if event.is_final and job.text_only:  # a text-only answer ends with its text
                        finished = True
                        if record:
                            self._record_text_finished()
                        return
                    continue
                audio = await self._fetch(event)
                now = time.monotonic()
                underrun = tracker.on_chunk(now, audio.duration_s)
                if underrun is not None and record:
                    self.metrics.underrun.observe(underrun)
                finished = audio.is_final
                frames = event.ref.chunk.kept_frames
                yield SentChunk(audio, audio.seq, tracker.ttfa_s, now - tracker.start_s, llm_replica, frames)
                progress.record(event)
                if finished:
                    if record:
                        self._record_finished(tracker, now)
                    return
                if self.drain.is_past_deadline:
                    raise Draining(self.config.drain.retry_after_s)
            raise StreamFailed("stream ended without a final chunk")
        finally:
            if not finished:
                stream.cancel()

    def _text_sent(
        self, delta: TextDelta, tracker: PlaybackTracker, next_seq: int, llm_replica: str, record: bool
    ) -> SentChunk:
        """A text-only SentChunk; the stream's first one is its time to first text."""
        elapsed_s = time.monotonic() - tracker.start_s
        if record and tracker.first_text_s is None:
            tracker.first_text_s = elapsed_s
            self.metrics.ttft.observe(elapsed_s)
        return SentChunk(None, next_seq, tracker.ttfa_s, elapsed_s, llm_replica, text=delta.text)

    async def _head(self, stream, req_id: str, is_resumed: bool) -> StreamHead:
        """The stream's head event. With no LLM replica left to route it to (Serve drops a dead replica
        when routing to it fails, then holds the request until it has started another one: 6-20 s), a
        new stream answers UNAVAILABLE at once, and a resumed one waits up to
        `migration.replacement_wait_s` for the replacement first (its client has audio, and then a gap)."""
        wait_s = self.config.migration.replacement_wait_s if is_resumed else 0.0
        head = await first_event(stream, OutageClock(self.llm_scope, wait_s, req_id).is_over)
        if head is None:
            raise ReplicasUnavailable(self.config.admission.unavailable_retry_after_s)
        return head

    async def _fetch(self, event: AudioReady) -> AudioChunk:
        """The chunk's audio, straight from the detok replica's object store; if it was lost (its replica died
        holding it), a detok replica decodes the (self-describing) chunk again, on its own (`TokenChunk.redo`: the
        stream's later chunks may be decoding there)."""
        try:
            return await self.step_audio.get(event.ref)
        except ObjectLostError:
            pass
        try:
            [ref] = await self.detok.decode_batch.remote([dataclasses.replace(event.ref.chunk, redo=True)])
            return (await ref.handle)[ref.index]
        except Exception as err:
            raise StreamFailed(f"audio of chunk {event.ref.seq} lost: {type(err).__name__}") from err

    def _record_text_finished(self) -> None:
        """A text-only answer finished: counted as a finished stream, and a viable one (it had no audio to
        play late); no TTFA, audio seconds or real-time factor (time to first text is recorded as sent)."""
        self.metrics.finished.inc()
        self.metrics.viable.inc()

    def _record_finished(self, tracker: PlaybackTracker | TextPacedPlayback, now_s: float) -> None:
        metrics = self.metrics
        metrics.finished.inc()
        if tracker.ttfa_s is not None:
            metrics.ttfa.observe(tracker.ttfa_s)
        if tracker.is_viable:
            metrics.viable.inc()
        metrics.audio.inc(tracker.audio_sent_s)
        metrics.set_realtime(tracker.audio_sent_s / max(now_s - tracker.start_s, 1e-6))

    def _check_head(self, head: StreamHead | AudioReady) -> str:
        """The replica serving the job; raises for a head that refuses it."""
        match head:
            case Admitted(llm_replica=replica) | Queued(llm_replica=replica):
                return replica
            case Rejected(retry_after_s=retry_after_s):
                self.metrics.rejections.inc()
                raise AdmissionRejected(retry_after_s)
            case Invalid(field=field, message=message):
                raise InvalidArgumentError(field, message)
            case Failed(message=message):
                raise StreamFailed(message)
            case Moved():  # a leaving replica bounced the stream
                raise StreamMoved(head)
        raise StreamFailed(f"unexpected stream head {type(head).__name__}")

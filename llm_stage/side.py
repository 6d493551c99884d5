"""The LLM side of a stream: the engine plus per-request chunkers and playback clocks.

`LLMSide` turns engine steps into ready, self-describing TokenChunks, stamps their deadlines,
sizes adaptive chunks by the client's buffer and tells the policy each request's next chunk.
The LLMStage deployment and the in-process pipeline (`cluster.pipeline`) both drive it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable

from core.messages import Checkpoint, HopTimes, Job, ResumeState, TextDelta, TextPiece, TokenChunk
from core.policy import buffered_s
from core.voices import is_voice_id
from llm_stage.chunking import Chunker, ChunkSchedule
from llm_stage.engine import LLMEngine, StepOutput
from llm_stage.faults import StepOutOfMemory
from llm_stage.migration import KVSnapshot
from llm_stage.request import Request
from llm_stage.text_out import TextStreams

BUFFER_SAFETY = 0.7  # share of the client's buffer a chunk may spend: step times jitter when streams join


class LLMSide:
    """LLM engine plus per-request chunkers: turns steps into ready TokenChunks.

    It also keeps each request's playback clock (`mark_audio_sent`), from which it stamps chunk
    deadlines for the detokenizer, sizes adaptive chunks by slack, and tells the policy how many
    steps each request needs until its next chunk.
    """

    def __init__(self, engine: LLMEngine, schedule: ChunkSchedule, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.schedule = schedule
        self.clock = clock
        self.chunkers: dict[str, Chunker] = {}
        self.num_checkpointed: dict[str, int] = {}  # tokens each stream's checkpoints cover so far
        self.checkpoints: dict[tuple[str, int], Checkpoint] = {}  # (req_id, seq) -> taken at its cut
        self.voice_handles: dict[str, str] = {}  # req_id -> its registered voice (stamped on its chunks)
        self.num_text_waits = 0  # times a streaming-text request had run out of text when more came
        adapter = engine.adapter
        # the answer's text beside its audio (speech-in families), taken with `take_text`
        speaks_text = getattr(adapter, "takes_audio", False)  # an engine stand-in's adapter may say nothing
        self.text_out = TextStreams(adapter.decode_text, clock) if speaks_text else None

    def add(self, job: Job, kv: KVSnapshot | None = None) -> None:
        """Queue `job`; a resumed one continues its chunks, decoding at once from a migrated `kv`;
        a later segment of an incremental stream keeps the stream's playback clock."""
        self.engine.add_job(job, kv)
        if is_voice_id(job.voice):
            self.voice_handles[job.req_id] = job.voice  # type: ignore[assignment]
        if job.buffered_audio_s is not None:
            self._continue_playback(job.req_id, job.buffered_audio_s)
        resume = job.resume
        self.num_checkpointed[job.req_id] = len(resume.tokens) if resume is not None else 0
        if resume is not None and self.text_out is not None:
            self.text_out.resume(job.req_id, self.engine.adapter.text_ids(list(resume.tokens)))
        if job.text_only:  # no speech: no chunker, no chunk (not even a final one) for the detokenizer
            return
        if resume is None:
            self.chunkers[job.req_id] = Chunker(job.req_id, self.schedule)
            return
        chunker = Chunker.resumed(job.req_id, self.schedule, resume.next_seq, resume.frames_shipped)
        chunker.add_frames(self.engine.replay_frames(job.req_id))  # its next step's push cuts what is ready
        self.chunkers[job.req_id] = chunker

    def _continue_playback(self, req_id: str, buffered_audio_s: float) -> None:
        """A later segment of a playing stream takes over its playback clock: the client holds
        `buffered_audio_s` of audio now, so the policy orders it by that deadline (steady phase)."""
        req = self.engine.requests[req_id]
        req.first_audio_s = self.clock()
        req.audio_sent_s = max(0.0, buffered_audio_s)

    def push_text(self, piece: TextPiece) -> bool:
        """More text for a streaming-text request (False: it is not here any more). Text that ends a
        wait whose client has played all its audio restarts its playback clock: the request then
        goes first like a new stream, as the client's silence was its own (no text), not ours."""
        req = self.engine.requests.get(piece.req_id)
        was_waiting = req is not None and req.is_waiting_for_text
        if not self.engine.push_text(piece.req_id, piece.text, piece.flush, piece.end):
            return False
        self.num_text_waits += was_waiting
        if was_waiting and not req.is_waiting_for_text and buffered_s(req, self.clock()) <= 0:
            req.first_audio_s, req.audio_sent_s = None, 0.0
        return True

    def cancel(self, req_id: str) -> None:
        self.engine.cancel(req_id)
        if self.text_out is not None:
            self.text_out.drop(req_id)
        self.chunkers.pop(req_id, None)
        self.num_checkpointed.pop(req_id, None)
        self.voice_handles.pop(req_id, None)

    def move_out(self, req_id: str) -> tuple[ResumeState, KVSnapshot | None] | None:
        """Stop a stream here so another engine continues it: its state (every sampled token,
        where its chunks stand) and its KV rows when they can move (None: not running,
        or it streams its text: that comes to this replica, so it finishes here)."""
        req, chunker = self.engine.requests.get(req_id), self.chunkers.get(req_id)
        if req is None or chunker is None or req.text_feed is not None:
            return None
        kv = self.engine.export_kv(req_id)
        tokens = tuple(req.output_ids)
        self.cancel(req_id)
        return ResumeState(tokens, chunker.next_seq, chunker.num_emitted), kv

    def steps_left(self, req_id: str) -> int | None:
        """The most steps `req_id` may still take here (to its max_tokens; a model's end token may
        come sooner); None when not known (not in the engine: not added yet or finished; or its
        text is still streaming in)."""
        req = self.engine.requests.get(req_id)
        if req is None or req.text_feed is not None:
            return None
        return max(0, req.sampling.max_tokens - len(req.output_ids))

    def take_checkpoints(self) -> dict[tuple[str, int], Checkpoint]:
        """The checkpoints of the last step's chunks (the LLMStage ships them with the audio)."""
        taken, self.checkpoints = self.checkpoints, {}
        return taken

    def mark_audio_sent(self, req_id: str, duration_s: float, num_frames: int = 0) -> None:
        """The audio of one chunk left for the client: advance that request's playback clock
        (and tell the policy how long a frame plays)."""
        self.engine.timer.record_audio(duration_s, num_frames)
        req = self.engine.requests.get(req_id)
        if req is None or duration_s <= 0:
            return
        if req.first_audio_s is None:
            req.first_audio_s = self.clock()
        req.audio_sent_s += duration_s

    def step(self) -> list[TokenChunk]:
        """The chunks this engine step cut; a step out of memory raises `StepOutOfMemory` once the
        requests it failed are gone from here too (the caller fails their streams)."""
        self.checkpoints = {}  # kept for one step: an in-process caller never takes them
        try:
            outputs = self.engine.step()
        except StepOutOfMemory as err:
            for req_id in err.req_ids:
                self.cancel(req_id)
            raise
        chunks = [c for out in outputs for c in self._chunks(out)]
        if self.text_out is not None:
            text_ids = self.engine.adapter.text_ids
            for out in outputs:
                checkpoint = functools.partial(self._text_checkpoint, out.req_id)
                self.text_out.push(out.req_id, text_ids(out.new_token_ids), out.finished, checkpoint)
        for out in outputs:
            if out.finished:  # (a text-only answer has no chunker to drop it with)
                self.num_checkpointed.pop(out.req_id, None)
        self._update_next_chunk_steps()
        return chunks

    def take_text(self) -> list[TextDelta]:
        """The answer text the steps since the last call decoded, in order (speech-in families; else none)."""
        return self.text_out.take() if self.text_out is not None else []

    def _chunks(self, out: StepOutput) -> list[TokenChunk]:
        chunker = self.chunkers.get(out.req_id)
        if chunker is None:
            return []
        req = self.engine.requests.get(out.req_id)
        chunks = chunker.push(out.new_frames, self._frame_budget(req))
        if chunks and not out.finished:
            self._checkpoint(req, chunks[0].seq)
        if out.finished:
            chunks += chunker.finish()
            del self.chunkers[out.req_id]
            self.num_checkpointed.pop(out.req_id, None)
        deadline, hops = self._deadline_wall_s(req), HopTimes(chunk_ready_unix_s=time.time())
        voice = self.voice_handles.pop(out.req_id, None) if out.finished else self.voice_handles.get(out.req_id)
        return [dataclasses.replace(c, deadline_s=deadline, hops=hops, voice_handle=voice) for c in chunks]

    def _checkpoint(self, req: Request, seq: int) -> None:
        """The sampler state after this step's tokens, kept with the step's first chunk of `req`
        (a finished request needs none: the router resumes it from its previous checkpoint, and
        greedy / seeded sampling regenerate the same last tokens)."""
        self.checkpoints[(req.req_id, seq)] = self._new_checkpoint(req)

    def _text_checkpoint(self, req_id: str) -> Checkpoint | None:
        """The sampler state after this step, for the text delta it decoded (None: nothing new since the
        step's chunk took it, or the request is gone)."""
        req = self.engine.requests.get(req_id)
        if req is None or req_id not in self.num_checkpointed:
            return None
        checkpoint = self._new_checkpoint(req)
        return checkpoint if checkpoint.new_tokens else None

    def _new_checkpoint(self, req: Request) -> Checkpoint:
        """The tokens `req` sampled since its previous checkpoint, now checkpointed."""
        start = self.num_checkpointed.get(req.req_id, 0)
        tokens = tuple(req.output_ids[start:])
        self.num_checkpointed[req.req_id] = start + len(tokens)
        return Checkpoint(start, tokens)

    def num_starving(self) -> int:
        """Streams playing whose client buffer is spent (safe to call from another thread: the
        requests are copied in one C-level call)."""
        now_s = self.clock()
        return sum(
            1
            for req in list(self.engine.requests.values())
            if req.first_audio_s is not None and buffered_s(req, now_s) <= 0
        )

    def _frame_budget(self, req: Request | None) -> int | None:
        """Frames the client's buffer can wait for before the next chunk must be out (None = no limit)."""
        if req is None or req.first_audio_s is None:
            return None
        timer = self.engine.timer
        frame_cost_s = self.engine.adapter.steps_per_frame * timer.step_s
        usable_s = BUFFER_SAFETY * buffered_s(req, self.clock()) - timer.detok_s
        return int(usable_s / max(frame_cost_s, 1e-6))

    def _deadline_wall_s(self, req: Request | None) -> float | None:
        if req is None or req.first_audio_s is None:
            return None
        return time.time() + buffered_s(req, self.clock())

    def _update_next_chunk_steps(self) -> None:
        """Tell the policy the tokens each request needs before it can ship audio again: the
        smallest next chunk, not the adaptive size planned from its buffer. The planned size
        spends most of the buffer by design (BUFFER_SAFETY), so slack measured on it stayed under
        the urgency threshold for nearly every stream and startups never went ahead of one."""
        steps_per_frame = self.engine.adapter.steps_per_frame
        for req_id, chunker in self.chunkers.items():
            req = self.engine.requests.get(req_id)
            if req is not None:
                req.tokens_to_next_chunk = math.ceil(chunker.frames_to_smallest_next_chunk() * steps_per_frame)

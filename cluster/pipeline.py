"""In-process synthesis: both engines in one process, no Ray (CLI, tests, benchmarks).

Each `step` runs one LLM step, cuts new frames into chunks per request, and runs one detok
step. The cluster runs the same pieces inside the LLMStage and DetokStage deployments.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import torch

from cluster.config import EngineConfig
from cluster.registry import check_model_config
from cluster.types import AudioChunk, SamplingParams, TokenChunk
from detok_stage.chunking import Chunker, ChunkSchedule
from detok_stage.engine import DetokEngine
from detok_stage.worker import DetokWorker
from llm_stage.engine import LLMEngine, StepOutput
from llm_stage.policy import buffered_s
from llm_stage.request import Request


def apply_torch_threads(num_threads: int) -> None:
    """Small decode ops are faster on one thread than on a contended pool; 0 keeps torch's default."""
    if num_threads:
        torch.set_num_threads(num_threads)


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

    def add(self, req_id: str, text: str, voice: str | None, sampling: SamplingParams | dict | None) -> None:
        self.engine.add_request(req_id, text, voice, sampling)
        self.chunkers[req_id] = Chunker(req_id, self.schedule)

    def cancel(self, req_id: str) -> None:
        self.engine.cancel(req_id)
        self.chunkers.pop(req_id, None)

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
        chunks = [c for out in self.engine.step() for c in self._chunks(out)]
        self._update_next_chunk_steps()
        return chunks

    def _chunks(self, out: StepOutput) -> list[TokenChunk]:
        chunker = self.chunkers.get(out.req_id)
        if chunker is None:
            return []
        req = self.engine.requests.get(out.req_id)
        chunks = chunker.push(out.new_frames, self._frame_budget(req))
        if out.finished:
            chunks += chunker.finish()
            del self.chunkers[out.req_id]
        deadline = self._deadline_wall_s(req)
        return [dataclasses.replace(c, deadline_s=deadline) for c in chunks]

    def _frame_budget(self, req: Request | None) -> int | None:
        """Frames the client's buffer can wait for before the next chunk must be out (None = no limit)."""
        if req is None or req.first_audio_s is None:
            return None
        timer = self.engine.timer
        frame_cost_s = self.engine.adapter.tokens_per_frame * timer.step_s
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
        tokens_per_frame = self.engine.adapter.tokens_per_frame
        for req_id, chunker in self.chunkers.items():
            req = self.engine.requests.get(req_id)
            if req is not None:
                req.tokens_to_next_chunk = chunker.frames_to_smallest_next_chunk() * tokens_per_frame


class InProcessPipeline:
    """Both engines in one process; the detokenizer runs on its own thread (`DetokWorker`), so
    decoding overlaps the next LLM steps, as the two stages overlap in the cluster."""

    def __init__(self, config: EngineConfig) -> None:
        entry = check_model_config(config.model)
        apply_torch_threads(config.model.torch_threads)
        adapter = entry.build_lm(config.model)
        self.llm = LLMSide(
            LLMEngine(adapter, config.cache, config.scheduler, seed=config.model.seed),
            ChunkSchedule.for_policy(config.detok, config.scheduler.policy),
        )
        codec = entry.build_codec(config.model, config.detok.device)
        self.detok = DetokEngine(codec, config.detok, policy=config.scheduler.policy)
        self.worker = DetokWorker(self.detok, on_decoded=self.llm.engine.timer.record_detok)

    @property
    def has_work(self) -> bool:
        return self.llm.engine.has_work or self.worker.num_in_flight > 0

    def submit(self, req_id: str, text: str, voice: str | None = None, sampling: SamplingParams | dict | None = None):
        self.llm.add(req_id, text, voice, sampling)

    def cancel(self, req_id: str) -> None:
        self.llm.cancel(req_id)
        self.worker.release(req_id)

    def step(self) -> list[AudioChunk]:
        """One LLM step (when it has work); hands new chunks to the detokenizer; returns decoded audio."""
        llm_busy = self.llm.engine.has_work
        if llm_busy:
            for chunk in self.llm.step():
                self.worker.submit(chunk)
        audio = self.worker.collect(wait_s=0.0 if llm_busy else 0.05)
        for chunk in audio:
            self.llm.mark_audio_sent(chunk.req_id, chunk.duration_s, chunk.num_frames)
        return audio

    def close(self) -> None:
        self.worker.stop()
        self.detok.close()
        self.llm.engine.close()

    def stream(self) -> Iterator[AudioChunk]:
        while self.has_work:
            yield from self.step()

    def synthesize(self, text: str, voice: str | None = None, sampling: SamplingParams | dict | None = None) -> bytes:
        """One request start to end; returns its PCM16 audio."""
        req_id = f"synth-{id(text)}-{len(self.llm.engine.requests)}"
        self.submit(req_id, text, voice, sampling)
        return b"".join(c.pcm16 for c in self.stream() if c.req_id == req_id)

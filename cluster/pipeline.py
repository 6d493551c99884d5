"""In-process synthesis: both engines in one process, no Ray (CLI, tests, benchmarks).

Each `step` runs one LLM step, cuts new frames into chunks per request, and runs one detok
step. The cluster runs the same pieces inside the LLMStage and DetokStage deployments.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from core.config import EngineConfig
from core.messages import AudioChunk, Job, SamplingParams, TextDelta
from detok_stage.worker import DetokWorker
from llm_stage.wiring import build_detok_engine, build_llm_side


@dataclass(frozen=True)
class SpokenAnswer:
    """A speech-in request's answer: its audio, its text, and when each began (from submission)."""

    pcm16: bytes
    text: str
    first_text_s: float | None  # time to first text (None: the answer had no text)
    first_audio_s: float | None  # time to first audio


class InProcessPipeline:
    """Both engines in one process; the detokenizer runs on its own thread (`DetokWorker`), so
    decoding overlaps the next LLM steps, as the two stages overlap in the cluster."""

    def __init__(self, config: EngineConfig) -> None:
        self.llm = build_llm_side(config)
        self.detok = build_detok_engine(config)
        self.worker = DetokWorker(self.detok, on_decoded=self.llm.engine.timer.record_detok)
        self.kept_frames: dict[tuple[str, int], tuple] = {}  # (req_id, seq) -> frames, for `add_job` only
        self._tracked: set[str] = set()
        self.text: list[TextDelta] = []  # speech in: the answers' text as decoded, until taken

    @property
    def has_work(self) -> bool:
        return self.llm.engine.has_work or self.worker.num_in_flight > 0

    def submit(self, req_id: str, text: str, voice: str | None = None, sampling: SamplingParams | dict | None = None):
        self.llm.add(self.llm.engine.job(req_id, text, voice, sampling))

    def cancel(self, req_id: str) -> None:
        self.llm.cancel(req_id)
        self.worker.release(req_id)

    def step(self) -> list[AudioChunk]:
        """One LLM step (when it has work); hands new chunks to the detokenizer; returns decoded audio."""
        llm_busy = self.llm.engine.has_work
        if llm_busy:
            for chunk in self.llm.step():
                if chunk.req_id in self._tracked:
                    self.kept_frames[(chunk.req_id, chunk.seq)] = chunk.kept_frames
                self.worker.submit(chunk)
            self.text += self.llm.take_text()
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

    def add_job(self, job: Job) -> None:
        """Queue a validated job whose chunks' codec frames are kept for `take_frames` (what an
        incremental stream keeps of a segment as context, as the cluster's router sees them)."""
        self._tracked.add(job.req_id)
        self.llm.add(job)

    def take_frames(self, chunk: AudioChunk) -> tuple:
        """The codec frames `chunk` of a job queued with `add_job` covers."""
        if chunk.is_final:
            self._tracked.discard(chunk.req_id)
        return self.kept_frames.pop((chunk.req_id, chunk.seq))

    def answer(self, job: Job) -> SpokenAnswer:
        """One speech-in job start to end: its audio and text, time to first text and first audio."""
        start = time.monotonic()
        self.llm.add(job)
        audio, text = [], []
        first_text_s = first_audio_s = None
        while self.has_work:
            for chunk in self.step():
                if chunk.req_id == job.req_id and chunk.pcm16 and first_audio_s is None:
                    first_audio_s = time.monotonic() - start
                audio += [chunk.pcm16] if chunk.req_id == job.req_id else []
            for delta in (d for d in self.text if d.req_id == job.req_id and d.text):
                first_text_s = first_text_s if first_text_s is not None else delta.decoded_s - start
                text.append(delta.text)
            self.text = [d for d in self.text if d.req_id != job.req_id]
        return SpokenAnswer(b"".join(audio), "".join(text), first_text_s, first_audio_s)

    def synthesize(self, text: str, voice: str | None = None, sampling: SamplingParams | dict | None = None) -> bytes:
        """One request start to end; returns its PCM16 audio."""
        req_id = f"synth-{id(text)}-{len(self.llm.engine.requests)}"
        self.submit(req_id, text, voice, sampling)
        return b"".join(c.pcm16 for c in self.stream() if c.req_id == req_id)

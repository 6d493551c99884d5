"""In-process synthesis: both engines in one process, no Ray (CLI, tests, benchmarks).

Each `step` runs one LLM step, cuts new frames into chunks per request, and runs one detok
step. The cluster runs the same pieces inside the LLMStage and DetokStage deployments.
"""

from __future__ import annotations

from collections.abc import Iterator

from core.config import EngineConfig
from core.messages import AudioChunk, Job, SamplingParams
from detok_stage.worker import DetokWorker
from llm_stage.wiring import build_detok_engine, build_llm_side


class InProcessPipeline:
    """Both engines in one process; the detokenizer runs on its own thread (`DetokWorker`), so
    decoding overlaps the next LLM steps, as the two stages overlap in the cluster."""

    def __init__(self, config: EngineConfig) -> None:
        self.llm = build_llm_side(config)
        self.detok = build_detok_engine(config)
        self.worker = DetokWorker(self.detok, on_decoded=self.llm.engine.timer.record_detok)
        self.kept_frames: dict[tuple[str, int], tuple] = {}  # (req_id, seq) -> frames, for `add_job` only
        self._tracked: set[str] = set()

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

    def synthesize(self, text: str, voice: str | None = None, sampling: SamplingParams | dict | None = None) -> bytes:
        """One request start to end; returns its PCM16 audio."""
        req_id = f"synth-{id(text)}-{len(self.llm.engine.requests)}"
        self.submit(req_id, text, voice, sampling)
        return b"".join(c.pcm16 for c in self.stream() if c.req_id == req_id)

"""In-process synthesis: both engines in one process, no Ray (CLI, tests, benchmarks).

Each `step` runs one LLM step, cuts new frames into chunks per request, and runs one detok
step. The cluster runs the same pieces inside the LLMStage and DetokStage deployments.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cluster.config import EngineConfig
from cluster.registry import check_model_config
from cluster.types import AudioChunk, SamplingParams, TokenChunk
from detok_stage.chunking import Chunker, ChunkSchedule
from detok_stage.engine import DetokEngine
from llm_stage.engine import LLMEngine, StepOutput


def apply_torch_threads(num_threads: int) -> None:
    """Small decode ops are faster on one thread than on a contended pool; 0 keeps torch's default."""
    if num_threads:
        torch.set_num_threads(num_threads)


class LLMSide:
    """LLM engine plus per-request chunkers: turns steps into ready TokenChunks."""

    def __init__(self, engine: LLMEngine, schedule: ChunkSchedule) -> None:
        self.engine = engine
        self.schedule = schedule
        self.chunkers: dict[str, Chunker] = {}

    def add(self, req_id: str, text: str, voice: str | None, sampling: SamplingParams | dict | None) -> None:
        self.engine.add_request(req_id, text, voice, sampling)
        self.chunkers[req_id] = Chunker(req_id, self.schedule)

    def cancel(self, req_id: str) -> None:
        self.engine.cancel(req_id)
        self.chunkers.pop(req_id, None)

    def step(self) -> list[TokenChunk]:
        return [c for out in self.engine.step() for c in self._chunks(out)]

    def _chunks(self, out: StepOutput) -> list[TokenChunk]:
        chunker = self.chunkers.get(out.req_id)
        if chunker is None:
            return []
        chunks = chunker.push(out.new_frames)
        if out.finished:
            chunks += chunker.finish()
            del self.chunkers[out.req_id]
        return chunks


class InProcessPipeline:
    def __init__(self, config: EngineConfig) -> None:
        entry = check_model_config(config.model)
        apply_torch_threads(config.model.torch_threads)
        adapter = entry.build_lm(config.model)
        self.llm = LLMSide(
            LLMEngine(adapter, config.cache, config.scheduler, seed=config.model.seed),
            ChunkSchedule.from_config(config.detok),
        )
        self.detok = DetokEngine(entry.build_codec(config.model, config.detok.device), config.detok)

    @property
    def has_work(self) -> bool:
        return self.llm.engine.has_work or self.detok.has_work

    def submit(self, req_id: str, text: str, voice: str | None = None, sampling: SamplingParams | dict | None = None):
        self.llm.add(req_id, text, voice, sampling)

    def cancel(self, req_id: str) -> None:
        self.llm.cancel(req_id)
        self.detok.release(req_id)

    def step(self) -> list[AudioChunk]:
        for chunk in self.llm.step():
            self.detok.submit(chunk)
        return self.detok.step()

    def stream(self) -> Iterator[AudioChunk]:
        while self.has_work:
            yield from self.step()

    def synthesize(self, text: str, voice: str | None = None, sampling: SamplingParams | dict | None = None) -> bytes:
        """One request start to end; returns its PCM16 audio."""
        req_id = f"synth-{id(text)}-{len(self.llm.engine.requests)}"
        self.submit(req_id, text, voice, sampling)
        return b"".join(c.pcm16 for c in self.stream() if c.req_id == req_id)

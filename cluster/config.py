"""Typed, validated configuration for VoxRay (pydantic, `extra="forbid"`).

One `VoxRayConfig` drives `voxray serve`, the Serve YAML and the k8s manifests; each component
receives only its own sub-config (`ModelConfig`, `CacheConfig`, `SchedulerConfig`, `DetokConfig`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Which model family to run and where its weights live."""

    name: str = Field("orpheus-tiny", description="Registry name of the model (see `voxray models`).")
    checkpoint_dir: Path | None = Field(None, description="Local HF-format LM checkpoint; None = preset weights.")
    codec_dir: Path | None = Field(None, description="Local codec checkpoint dir; None = preset weights.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("cpu", description="torch device for this stage, e.g. 'cpu' or 'cuda'.")
    seed: int = Field(0, description="Seed for preset random weights and unseeded sampling.")
    torch_threads: int = Field(0, ge=0, le=256, description="CPU threads for torch ops; 0 = torch's default.")


class CacheConfig(_Strict):
    """KV cache of the LLM stage: allocated once, `num_slots` sequences of `max_seq_len` tokens."""

    num_slots: int = Field(32, ge=1, le=4096, description="Concurrent sequences the KV cache holds.")
    max_seq_len: int = Field(2048, ge=16, le=131072, description="Tokens per sequence (prompt + output).")


class SchedulerConfig(_Strict):
    """LLM-stage batch selection."""

    policy: Literal["fcfs", "streaming", "throughput"] = "fcfs"
    max_batch_size: int = Field(32, ge=1, le=4096, description="Rows per decode step.")
    prefill_token_budget: int = Field(256, ge=1, description="Prompt tokens prefilled per step (chunked).")
    startup_concurrency: int = Field(4, ge=1, description="Streams allowed in the startup phase at once.")


class DetokConfig(_Strict):
    """Detokenizer chunk schedule and batching.

    `reference`: Orpheus' own semantics (1 frame per chunk, 1 frame left and 2 right context).
    `wide`: bigger chunks with fixed left/right context, so each frame is decoded fewer times.
    """

    schedule: Literal["reference", "wide"] = "wide"
    first_chunk_frames: int = Field(2, ge=1, description="Frames in the first chunk (wide schedule).")
    chunk_frames: int = Field(8, ge=1, description="Frames in later chunks (wide schedule).")
    left_context_frames: int = Field(3, ge=0, description="Frames of left context per window (wide).")
    right_context_frames: int = Field(3, ge=0, description="Frames of right context per window (wide).")
    max_batch_chunks: int = Field(32, ge=1, description="Chunks decoded in one detokenizer forward.")
    device: str = Field("cpu", description="torch device of the detokenizer stage.")


class EngineConfig(_Strict):
    """Everything the two in-process engines need."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    detok: DetokConfig = DetokConfig()

    @model_validator(mode="after")
    def _batch_fits_cache(self) -> EngineConfig:
        if self.scheduler.max_batch_size > self.cache.num_slots:
            raise ValueError("scheduler.max_batch_size must be <= cache.num_slots")
        return self


def load_engine_config(path: Path) -> EngineConfig:
    """Read an EngineConfig from a YAML file."""
    return EngineConfig.model_validate(yaml.safe_load(Path(path).read_text()) or {})

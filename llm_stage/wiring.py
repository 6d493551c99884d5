"""Engine wiring: the one place that builds the two engines from an EngineConfig.

The in-process pipeline (`cluster.pipeline`) and the Serve stages (`deployments/`) both call
`build_llm_side` / `build_detok_engine`, so they run the same engines, policy and chunk
schedule. `size_for_streams` sizes the KV cache and batch for an admission cap explicitly.
"""

from __future__ import annotations

import logging

import torch

from core.config import EngineConfig
from core.policy import make_policy
from detok_stage.engine import DetokEngine
from llm_stage.engine import LLMEngine
from llm_stage.registry import ModelEntry, check_engine_config
from llm_stage.side import LLMSide

logger = logging.getLogger(__name__)


def apply_torch_threads(num_threads: int) -> None:
    """Small decode ops are faster on one thread than on a contended pool; 0 keeps torch's default."""
    if num_threads:
        torch.set_num_threads(num_threads)


def size_for_streams(config: EngineConfig, entry: ModelEntry, max_streams: int) -> EngineConfig:
    """The engine config for a replica that admits `max_streams` streams: one KV slot per row a
    stream may hold (two for a family with CFG: the guided row and its twin), batch rows capped
    at that. Logged, since it replaces `cache.num_slots` / `scheduler.max_batch_size`."""
    num_slots = max_streams * entry.rows_per_stream
    batch = min(num_slots, config.scheduler.max_batch_size)
    logger.info(
        "KV cache: %d slots = %d streams x %d rows per stream (%s); batch rows %d",
        num_slots, max_streams, entry.rows_per_stream, entry.name, batch,
    )  # fmt: skip
    return config.model_copy(
        update={
            "cache": config.cache.model_copy(update={"num_slots": num_slots}),
            "scheduler": config.scheduler.model_copy(update={"max_batch_size": batch}),
        }
    )


def build_llm_side(config: EngineConfig) -> LLMSide:
    """The LLM engine (adapter, KV cache, scheduler with the configured policy) and its chunkers."""
    entry = check_engine_config(config)
    apply_torch_threads(config.model.torch_threads)
    engine = LLMEngine(entry.build_lm(config.model), config.cache, config.scheduler, seed=config.model.seed)
    return LLMSide(engine, entry.chunk_schedule(config, engine.policy))


def build_detok_engine(config: EngineConfig, in_order: bool = True) -> DetokEngine:
    """The detokenizer engine on the family's codec, ordering chunks by the configured policy."""
    entry = check_engine_config(config)
    apply_torch_threads(config.model.torch_threads)
    codec = entry.build_codec(config.model, config.detok.device)
    if config.detok.flow_window_frames:
        codec.bound_flow_history(config.detok.flow_sink_frames, config.detok.flow_window_frames)
    return DetokEngine(codec, config.detok, in_order=in_order, policy=make_policy(config.scheduler))

"""Model registry: a model name -> its LM adapter, codec adapter and defaults.

Engines, deployments and the CLI resolve `ModelConfig.name` here; unknown names raise an
error listing the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cluster.config import ModelConfig
from cluster.errors import InvalidArgumentError
from detok_stage.codecs.base import CodecAdapter
from llm_stage.models.base import LMAdapter


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    build_lm: Callable[[ModelConfig], LMAdapter]
    build_codec: Callable[[ModelConfig, str], CodecAdapter]
    needs_checkpoint: bool
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    sample_rate_hz: int = 24000


def _orpheus_lm(config: ModelConfig) -> LMAdapter:
    from llm_stage.models.orpheus import OrpheusAdapter

    return OrpheusAdapter.build(config)


def _snac(config: ModelConfig, device: str) -> CodecAdapter:
    from detok_stage.codecs.snac_codec import SnacCodec

    return SnacCodec.build(config, device)


_ORPHEUS_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")

REGISTRY: dict[str, ModelEntry] = {
    "orpheus-tiny": ModelEntry(
        "orpheus-tiny", "Orpheus layout, small random-weight Llama + small SNAC (built in code)",
        _orpheus_lm, _snac, needs_checkpoint=False, voices=_ORPHEUS_VOICES, default_voice="tara",
    ),
    "orpheus": ModelEntry(
        "orpheus", "Orpheus 3B (Llama-3.2-3B HF checkpoint) + SNAC 24 kHz, from local directories",
        _orpheus_lm, _snac, needs_checkpoint=True, voices=_ORPHEUS_VOICES, default_voice="tara",
    ),
}  # fmt: skip


def _parallel_heads_lm(config: ModelConfig) -> LMAdapter:
    from llm_stage.models.bagpiper import ParallelHeadsAdapter

    return ParallelHeadsAdapter.build(config)


def _xcodec(config: ModelConfig, device: str) -> CodecAdapter:
    from detok_stage.codecs.xcodec_codec import XcodecCodec

    return XcodecCodec.build(config, device)


def _csm_lm(config: ModelConfig) -> LMAdapter:
    from llm_stage.models.csm import CsmAdapter

    return CsmAdapter.build(config)


def _mimi(config: ModelConfig, device: str) -> CodecAdapter:
    from detok_stage.codecs.mimi_codec import MimiCodec

    return MimiCodec.build(config, device)


REGISTRY.update({
    "bagpiper-tiny": ModelEntry(
        "bagpiper-tiny", "Parallel heads + delay pattern + CFG (Qwen3, 8 X-Codec streams), random tiny weights",
        _parallel_heads_lm, _xcodec, needs_checkpoint=False,
    ),
    "bagpiper": ModelEntry(
        "bagpiper", "Parallel-heads Qwen3 checkpoint (+ parallel_heads.*) and an HF X-Codec dir, local",
        _parallel_heads_lm, _xcodec, needs_checkpoint=True,
    ),
    "csm-tiny": ModelEntry(
        "csm-tiny", "CSM layout: Llama backbone + depth decoder over 8 codebooks, small Mimi, random tiny weights",
        _csm_lm, _mimi, needs_checkpoint=False,
    ),
    "csm": ModelEntry(
        "csm", "Sesame CSM-1B (HF CsmForConditionalGeneration dir) + Mimi (HF MimiModel dir), local",
        _csm_lm, _mimi, needs_checkpoint=True,
    ),
})  # fmt: skip


def _dia_lm(config: ModelConfig) -> LMAdapter:
    from llm_stage.models.dia import DiaAdapter

    return DiaAdapter.build(config)


def _dac(config: ModelConfig, device: str) -> CodecAdapter:
    from detok_stage.codecs.dac_codec import DacCodec

    return DacCodec.build(config, device)


REGISTRY.update({
    "dia-tiny": ModelEntry(
        "dia-tiny", "Dia layout: byte text encoder + decoder over 4 delayed DAC channels, CFG, random tiny weights",
        _dia_lm, _dac, needs_checkpoint=False, sample_rate_hz=44100,
    ),
    "dia": ModelEntry(
        "dia", "Nari Labs Dia (HF DiaForConditionalGeneration dir) + DAC 44.1 kHz (HF DacModel dir), local",
        _dia_lm, _dac, needs_checkpoint=True, sample_rate_hz=44100,
    ),
})  # fmt: skip


def get_entry(name: str) -> ModelEntry:
    if name not in REGISTRY:
        raise InvalidArgumentError("model", f"unknown model {name!r}; valid models: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def check_model_config(config: ModelConfig) -> ModelEntry:
    """Resolve the entry and check that checkpoint-backed models name their directories."""
    entry = get_entry(config.name)
    if entry.needs_checkpoint and (config.checkpoint_dir is None or config.codec_dir is None):
        raise InvalidArgumentError("model.checkpoint_dir", f"{config.name} loads weights from local directories")
    return entry

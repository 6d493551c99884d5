"""Model registry: served model names -> the family that declares them, imported on first use.

Every family declares itself once, next to its LM adapter (`FAMILY` in `llm_stage/models/<name>.py`:
adapter, codec, sample rate, descriptions; voices, sampling defaults and token layout are the
adapter's own attributes). Each family serves two names: `<family>` loads weights from local
directories, `<family>-tiny` builds random preset weights in code. Engines, deployments, the
router and the CLI resolve `ModelConfig.name` here; unknown names raise an error listing the
valid ones.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from detok_stage.codecs.base import CodecAdapter
from llm_stage.models.base import LMAdapter, ModelFamily

FAMILY_MODULES = {
    "orpheus": "llm_stage.models.orpheus",
    "csm": "llm_stage.models.csm",
    "bagpiper": "llm_stage.models.bagpiper",
    "dia": "llm_stage.models.dia",
}
PRESET_SUFFIX = "-tiny"


@dataclass(frozen=True)
class ModelEntry:
    """One served model name: a family with checkpoint weights or with its random preset."""

    name: str
    family: ModelFamily
    is_preset: bool

    @property
    def description(self) -> str:
        return self.family.preset_description if self.is_preset else self.family.description

    @property
    def needs_checkpoint(self) -> bool:
        return not self.is_preset

    @property
    def voices(self) -> tuple[str, ...]:
        return self.family.lm.voices

    @property
    def default_voice(self) -> str | None:
        return self.family.lm.default_voice

    @property
    def sample_rate_hz(self) -> int:
        return self.family.sample_rate_hz

    @property
    def default_sampling(self) -> SamplingParams:
        return self.family.lm.default_sampling

    @property
    def rows_per_stream(self) -> int:
        """KV slots and batch rows one stream may hold: two when the family runs CFG (a twin)."""
        return 2 if self.family.lm.guidance is not None else 1

    def build_lm(self, config: ModelConfig) -> LMAdapter:
        return self.family.lm.build(config)

    def build_codec(self, config: ModelConfig, device: str) -> CodecAdapter:
        return self.family.codec.build(config, device)


def model_names() -> list[str]:
    """Every servable name, without importing any family."""
    return sorted(name for family in FAMILY_MODULES for name in (family, family + PRESET_SUFFIX))


def load_family(family_name: str) -> ModelFamily:
    family: ModelFamily = importlib.import_module(FAMILY_MODULES[family_name]).FAMILY
    return family


def get_entry(name: str) -> ModelEntry:
    family_name = name.removesuffix(PRESET_SUFFIX)
    if family_name not in FAMILY_MODULES:
        raise InvalidArgumentError("model", f"unknown model {name!r}; valid models: {', '.join(model_names())}")
    return ModelEntry(name, load_family(family_name), is_preset=name != family_name)


def check_model_config(config: ModelConfig) -> ModelEntry:
    """Resolve the entry and check that checkpoint-backed models name their directories."""
    entry = get_entry(config.name)
    if entry.needs_checkpoint and (config.checkpoint_dir is None or config.codec_dir is None):
        raise InvalidArgumentError("model.checkpoint_dir", f"{config.name} loads weights from local directories")
    return entry

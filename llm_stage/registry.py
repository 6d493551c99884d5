"""Model registry: served model names -> the family that declares them, imported on first use.

Every family declares itself once, next to its LM adapter (`FAMILY` in `llm_stage/models/<name>.py`:
adapter, codec, sample rate, published repo ids, descriptions; voices, sampling defaults and token
layout are the adapter's own attributes). Each family serves two names: `<family>` loads a
checkpoint (a local directory or a Hugging Face repo id from the local cache), `<family>-tiny`
builds random preset weights in code. Engines, deployments, the router and the CLI resolve
`ModelConfig.name` here; unknown names raise an error listing the valid ones. `model_config_for`
turns a CLI `--model REF` (a name, a repo id or a directory) into a ModelConfig, finding the family
from the checkpoint's config.json (or, for a directory without one, the family's marker file).
`check_engine_config` also checks the chunk schedule against what the family's detokenizer needs
(S3Gen: 3 look-ahead frames, the stream from frame 0), so a bad one fails before any engine runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.checkpoints import ModelRef, read_config, resolve_model_ref
from core.config import EngineConfig, ModelConfig
from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from core.policy import SchedulingPolicy, make_policy
from detok_stage.codecs.base import CodecAdapter
from llm_stage.chunking import ChunkSchedule
from llm_stage.models.base import LMAdapter, ModelFamily

FAMILY_MODULES = {
    "orpheus": "llm_stage.models.orpheus",
    "csm": "llm_stage.models.csm",
    "parallel-heads": "llm_stage.models.parallel_heads",
    "dia": "llm_stage.models.dia",
    "qwen3-tts": "llm_stage.models.qwen3_tts",
    "cosyvoice2": "llm_stage.models.cosyvoice2",
    "chatterbox": "llm_stage.models.chatterbox",
    "step-audio2": "llm_stage.models.step_audio2",
    "glm4-voice": "llm_stage.models.glm4_voice",
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

    def with_defaults(self, config: ModelConfig) -> ModelConfig:
        """`config` with the family's published codec (and speech tokenizer) filled in for a checkpoint model
        that names none."""
        if self.is_preset:
            return config
        published = {
            "codec_dir": self.family.codec_repo_id,
            "speech_tokenizer_dir": self.family.speech_tokenizer_repo_id,
        }
        missing = {name: repo for name, repo in published.items() if repo is not None and getattr(config, name) is None}
        return config.model_copy(update=missing) if missing else config

    def build_lm(self, config: ModelConfig) -> LMAdapter:
        return self.family.lm.build(self.with_defaults(config))

    def build_codec(self, config: ModelConfig, device: str) -> CodecAdapter:
        return self.family.codec.build(self.with_defaults(config), device)

    def chunk_schedule(self, config: EngineConfig, policy: SchedulingPolicy | None = None) -> ChunkSchedule:
        """The schedule the LLM side cuts this model's chunks by (`detok.schedule: auto` = the family's
        own where it declares one). A schedule the family's detokenizer cannot stream is refused
        naming the field, so it never reaches a replica as a run-time cache miss."""
        detok = config.detok
        schedule = ChunkSchedule.for_policy(detok, policy or make_policy(config.scheduler), self.family.chunk_schedule)
        codec = self.family.codec
        if not (codec.min_right_context_frames or codec.needs_stream_history):
            return schedule
        if detok.schedule == "reference":
            raise InvalidArgumentError(
                "detok.schedule", f"{self.name} streams a stateful detokenizer; use auto (its own schedule) or wide"
            )
        if schedule.right_context_frames < codec.min_right_context_frames:
            raise InvalidArgumentError(
                "detok.right_context_frames",
                f"{self.name}'s detokenizer looks {codec.min_right_context_frames} frames ahead: right_context_frames "
                f"must be >= {codec.min_right_context_frames}, got {schedule.right_context_frames}",
            )
        max_frames = int(config.cache.max_seq_len // self.family.lm.steps_per_frame)
        if codec.needs_stream_history and schedule.left_context_frames < max_frames:
            raise InvalidArgumentError(
                "detok.left_context_frames",
                f"{self.name}'s detokenizer rebuilds a request on a cold replica from the stream's frame 0: "
                f"left_context_frames must cover a whole stream (cache.max_seq_len {config.cache.max_seq_len} "
                f"tokens = {max_frames} frames), got {schedule.left_context_frames}",
            )
        return schedule


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


def families() -> list[ModelFamily]:
    return [load_family(name) for name in FAMILY_MODULES]


def check_model_config(config: ModelConfig) -> ModelEntry:
    """Resolve the entry; for a checkpoint model, resolve its references (missing ones raise with the
    download command) and check that the checkpoint is this family's."""
    entry = get_entry(config.name)
    if entry.is_preset:
        return entry
    family = entry.family
    if config.checkpoint_dir is None:
        hint = f" (e.g. {family.repo_id})" if family.repo_id else ""
        raise InvalidArgumentError(
            "model.checkpoint_dir", f"{config.name} needs a checkpoint: a directory or repo id{hint}"
        )
    found = family_of_checkpoint(resolve_model_ref(config.checkpoint_dir))
    if found is not None and found.name != family.name:
        raise InvalidArgumentError("model.checkpoint_dir", f"{config.checkpoint_dir} is a {found.name} checkpoint")
    filled = entry.with_defaults(config)
    if filled.speech_tokenizer_dir is not None:
        resolve_model_ref(filled.speech_tokenizer_dir, field="model.speech_tokenizer_dir")
    codec = filled.codec_dir
    if codec is not None:
        resolve_model_ref(codec, field="model.codec_dir")
    elif not family.codec_in_checkpoint:
        raise InvalidArgumentError("model.codec_dir", f"{config.name} needs a codec checkpoint (directory or repo id)")
    return entry


def check_engine_config(config: EngineConfig) -> ModelEntry:
    """`check_model_config`, the chunk schedule checked against the family's detokenizer, and a bounded
    flow history refused where the detokenizer has none."""
    entry = check_model_config(config.model)
    entry.chunk_schedule(config)
    detok = config.detok
    if (detok.flow_window_frames or detok.flow_sink_frames) and not entry.family.codec.bounds_flow_history:
        field = "detok.flow_window_frames" if detok.flow_window_frames else "detok.flow_sink_frames"
        raise InvalidArgumentError(
            field, f"{entry.name}'s detokenizer has no flow estimator history to bound (S3Gen families only)"
        )
    if detok.flow_sink_frames and not detok.flow_window_frames:
        raise InvalidArgumentError("detok.flow_sink_frames", "a sink only bounds a history with flow_window_frames > 0")
    return entry


def family_of_checkpoint(directory: Path) -> ModelFamily | None:
    """The family whose `is_checkpoint` accepts the directory's config.json, or whose marker file
    the directory holds (published layouts without a config.json), if any."""
    config = read_config(directory)

    def matches(family: ModelFamily) -> bool:
        marker = family.checkpoint_marker
        return family.is_checkpoint(config) or (marker is not None and (Path(directory) / marker).is_file())

    return next((family for family in families() if matches(family)), None)


def model_config_for(model: ModelRef, codec: ModelRef | None = None, **fields: Any) -> ModelConfig:
    """A served name (`orpheus-tiny`), or a checkpoint reference whose family is found from its
    config.json or marker file."""
    if str(model) in model_names():
        return ModelConfig(name=str(model), codec_dir=codec, **fields)
    family = family_of_checkpoint(resolve_model_ref(model, field="model"))
    if family is None:
        known = ", ".join(f.name for f in families())
        raise InvalidArgumentError("model", f"{model} is no checkpoint of a known family ({known}) nor a model name")
    return ModelConfig(name=family.name, checkpoint_dir=model, codec_dir=codec, **fields)

"""Which Serve deployments an app runs for the models it serves, and which models share a detokenizer.

`plan_models(config)` turns a ServeConfig into one `ServedModel` per model: the config as that model's
stages see it (`ServeConfig.for_model`), its LLM deployment's name and its DetokStage deployment's.
A single-model config keeps the names it always had (`LLMStage`, `DetokStage`); in a multi-model
config each model gets `LLMStage-<model>`, and models whose detokenizers are the same (`detok_key`:
codec, weights, chunk settings; e.g. `cosyvoice2-tiny` and `chatterbox-tiny`, both on the same
seeded S3Gen) share one `DetokStage-<codec>`. Used by `deployments.app`, `cluster.serve_yaml` and
`voxray models --config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import EngineConfig, ServeConfig, StageDeploymentConfig
from core.errors import InvalidArgumentError
from llm_stage.registry import get_entry

LLM_DEPLOYMENT = "LLMStage"
DETOK_DEPLOYMENT = "DetokStage"


@dataclass(frozen=True)
class ServedModel:
    """One served model: its stages' view of the config and the deployments that run it."""

    name: str
    view: ServeConfig  # `engine`, `llm`, `detok` of this model; `models` empty
    llm_deployment: str
    detok_deployment: str
    shares_detok_with: tuple[str, ...] = ()  # the other models decoded by the same DetokStage deployment

    @property
    def detok_stage(self) -> StageDeploymentConfig:
        return self.view.detok


def detok_key(engine: EngineConfig) -> tuple:
    """What makes two models' detokenizers interchangeable: the codec class, where its weights come from
    (the codec checkpoint, else the LM checkpoint holding it, else the seed of preset weights), dtype,
    and the detok engine's settings (chunk schedule, batching, device, order policy)."""
    entry = get_entry(engine.model.name)
    model = entry.with_defaults(engine.model)
    codec = entry.family.codec
    if model.codec_dir is not None:
        source: tuple = ("codec", str(model.codec_dir))
    elif model.checkpoint_dir is not None:
        source = ("checkpoint", str(model.checkpoint_dir))
    else:
        source = ("preset", model.seed)
    detok = engine.detok.model_dump(mode="json")
    return (f"{codec.__module__}.{codec.__qualname__}", source, model.dtype, str(detok), engine.scheduler.policy)


def codec_slug(engine: EngineConfig) -> str:
    """`S3GenCodec` -> `s3gen`: the readable part of a shared DetokStage deployment's name."""
    name = get_entry(engine.model.name).family.codec.__name__
    return name.removesuffix("Codec").lower() or "codec"


def plan_models(config: ServeConfig) -> list[ServedModel]:
    """One `ServedModel` per served model, in the config's order (the first is the default)."""
    if not config.models:
        name = config.engine.model.name
        return [ServedModel(name, config.for_model(config.served_models()[0]), LLM_DEPLOYMENT, DETOK_DEPLOYMENT)]
    groups = _detok_groups(config)
    planned = []
    for served in config.models:
        name = served.engine.model.name
        detok_name, members = groups[name]
        planned.append(
            ServedModel(
                name, config.for_model(served), f"{LLM_DEPLOYMENT}-{name}", detok_name,
                tuple(member for member in members if member != name),
            )
        )  # fmt: skip
    return planned


def _detok_groups(config: ServeConfig) -> dict[str, tuple[str, list[str]]]:
    """model name -> (its DetokStage deployment's name, the models in that deployment). A shared
    deployment runs with the first member's `detok` settings; another member naming different
    ones is refused, naming the field."""
    by_key: dict[tuple, list[int]] = {}
    for index, served in enumerate(config.models):
        by_key.setdefault(detok_key(served.engine), []).append(index)
    groups: dict[str, tuple[str, list[str]]] = {}
    used: set[str] = set()
    for indices in by_key.values():
        first = config.models[indices[0]]
        for index in indices[1:]:
            if config.models[index].detok != first.detok:
                raise InvalidArgumentError(
                    f"models[{index}].detok",
                    f"{config.models[index].engine.model.name} shares its detokenizer with "
                    f"{first.engine.model.name}: give the same detok deployment settings or leave them out",
                )
        slug = codec_slug(first.engine)
        name = f"{DETOK_DEPLOYMENT}-{slug}"
        suffix = 2
        while name in used:
            name, suffix = f"{DETOK_DEPLOYMENT}-{slug}-{suffix}", suffix + 1
        used.add(name)
        members = [config.models[index].engine.model.name for index in indices]
        for member in members:
            groups[member] = (name, members)
    return groups


def describe_plan(config: ServeConfig) -> list[str]:
    """`voxray models --config`: each served model and the deployments that run it."""
    lines = []
    for index, served in enumerate(plan_models(config)):
        default = "  (default)" if index == 0 else ""
        shared = f", shared with {', '.join(served.shares_detok_with)}" if served.shares_detok_with else ""
        lines.append(f"{served.name}{default}: {served.llm_deployment} -> {served.detok_deployment}{shared}")
    return lines

"""HyperPyYAML (the `cosyvoice2.yaml` / glm-4-voice-decoder `config.yaml` format) read as data: nothing is
imported or constructed, a tagged node (`!new:pkg.Class {...}`, `!ref <name>`) becomes a `Tagged`. Used by
the loaders of published checkpoints that ship such a file (CosyVoice 2's LM, GLM-4-Voice's decoder)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml


@dataclass(frozen=True)
class Tagged:
    """A HyperPyYAML node with its tag: `!new:pkg.Class {...}` -> ("new:pkg.Class", {...})."""

    tag: str
    value: Any


class _DataLoader(yaml.SafeLoader):
    """A SafeLoader whose tagged nodes become `Tagged`."""


def _construct_tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Tagged:
    if isinstance(node, yaml.MappingNode):
        return Tagged(suffix, loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Tagged(suffix, loader.construct_sequence(node, deep=True))
    return Tagged(suffix, loader.construct_scalar(node))  # type: ignore[arg-type]


_DataLoader.add_multi_constructor("!", _construct_tagged)


def load_data(text: str) -> Any:
    """The document's data, tagged nodes as `Tagged`."""
    return yaml.load(text, Loader=_DataLoader)  # noqa: S506 (a SafeLoader subclass)


def resolve_ref(top: dict, value: Any) -> Any:
    """`!ref <name>` -> the top-level value it names; anything else as it is."""
    if isinstance(value, Tagged) and value.tag == "ref":
        return top.get(str(value.value).strip().strip("<>"))
    return value

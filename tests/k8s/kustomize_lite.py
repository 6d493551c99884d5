"""Render our kustomizations in Python, for tests on machines without kustomize.

Implements only what k8s/ uses: `resources` (files and directories), `configMapGenerator` (files, no name
hash), `generatorOptions.labels`, JSON6902 `patches` with a kind/name target, `images` and `namespace`.
Any other kustomization key raises, so a new feature in k8s/ needs a matching change here; where kubectl
is installed, tests/k8s checks that this renders the same objects as `kubectl kustomize`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions", "patches"}
SUPPORTED_KEYS |= {"images", "namespace"}


class UnsupportedKustomizationError(ValueError):
    """The kustomization uses something this renderer does not implement."""


def render(directory: Path) -> list[dict[str, Any]]:
    """All objects `kustomize build directory` would emit (order: resources, then generated)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}
    unknown = set(kustomization) - SUPPORTED_KEYS
    if unknown:
        raise UnsupportedKustomizationError(f"{directory}: unsupported kustomization keys {sorted(unknown)}")
    objects = [obj for entry in kustomization.get("resources", []) for obj in _load_resource(directory / entry)]
    objects += _generate_config_maps(directory, kustomization)
    for patch in kustomization.get("patches", []):
        _apply_patch_entry(directory, patch, objects)
    for image in kustomization.get("images", []):
        _set_image(objects, image)
    if "namespace" in kustomization:
        for obj in objects:
            obj.setdefault("metadata", {})["namespace"] = kustomization["namespace"]
    return objects


def _load_resource(path: Path) -> list[dict[str, Any]]:
    if path.is_dir():
        return render(path)
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _generate_config_maps(directory: Path, kustomization: dict[str, Any]) -> list[dict[str, Any]]:
    options = kustomization.get("generatorOptions", {})
    if kustomization.get("configMapGenerator") and not options.get("disableNameSuffixHash"):
        raise UnsupportedKustomizationError("configMapGenerator needs generatorOptions.disableNameSuffixHash: true")
    maps = []
    for generator in kustomization.get("configMapGenerator", []):
        if set(generator) - {"name", "files"}:
            raise UnsupportedKustomizationError(f"configMapGenerator supports name and files only: {generator}")
        data = {Path(name).name: (directory / name).read_text() for name in generator["files"]}
        metadata: dict[str, Any] = {"name": generator["name"]}
        if options.get("labels"):
            metadata["labels"] = dict(options["labels"])
        maps.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    return maps


def _apply_patch_entry(directory: Path, entry: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    operations = yaml.safe_load((directory / entry["path"]).read_text())
    target = entry.get("target", {})
    if not isinstance(operations, list) or set(target) - {"kind", "name"} or not target:
        raise UnsupportedKustomizationError(f"only JSON6902 patches with a kind/name target: {entry}")
    matches = [obj for obj in objects if all(_selector_value(obj, key) == value for key, value in target.items())]
    if not matches:
        raise UnsupportedKustomizationError(f"patch {entry['path']} matches no object")
    for obj in matches:
        for operation in operations:
            apply_operation(obj, operation)


def _selector_value(obj: dict[str, Any], key: str) -> Any:
    return obj["kind"] if key == "kind" else obj["metadata"]["name"]


def _parent(doc: Any, pointer: str) -> tuple[Any, str]:
    """Container of the JSON pointer's last token, and that token (RFC 6901 unescaped)."""
    if not pointer.startswith("/"):
        raise ValueError(f"JSON pointer must start with '/': {pointer!r}")
    tokens = [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]
    for token in tokens[:-1]:
        doc = doc[int(token)] if isinstance(doc, list) else doc[token]
    return doc, tokens[-1]


def apply_operation(doc: dict[str, Any], operation: dict[str, Any]) -> None:
    """One RFC 6902 operation (add / replace / remove / test), in place; missing paths and failed tests
    raise like kustomize."""
    parent, token = _parent(doc, operation["path"])
    op = operation["op"]
    value = copy.deepcopy(operation.get("value"))
    if op == "test":
        found = parent[int(token)] if isinstance(parent, list) else parent.get(token)
        if found != value:
            raise ValueError(f"JSON6902 test failed at {operation['path']}: {found!r} != {value!r}")
        return
    if isinstance(parent, list):
        index = len(parent) if token == "-" else int(token)
        if op == "add":
            parent.insert(index, value)
        elif op == "replace":
            parent[index] = value
        elif op == "remove":
            del parent[index]
        else:
            raise UnsupportedKustomizationError(f"unsupported JSON6902 op {op!r}")
        return
    if op in ("replace", "remove") and token not in parent:
        raise KeyError(f"{op} of missing path {operation['path']}")
    if op in ("add", "replace"):
        parent[token] = value
    elif op == "remove":
        del parent[token]
    else:
        raise UnsupportedKustomizationError(f"unsupported JSON6902 op {op!r}")


def _set_image(objects: list[dict[str, Any]], image: dict[str, Any]) -> None:
    for container in _containers(objects):
        name, _, tag = container.get("image", "").partition(":")
        if name == image["name"]:
            new_name = image.get("newName", name)
            new_tag = image.get("newTag", tag)
            container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name


def _containers(node: Any) -> list[dict[str, Any]]:
    """Every item of a `containers` / `initContainers` list anywhere in the objects."""
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                found += [item for item in value if isinstance(item, dict)]
            found += _containers(value)
    elif isinstance(node, list):
        for item in node:
            found += _containers(item)
    return found

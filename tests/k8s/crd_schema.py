"""Convert a CustomResourceDefinition's openAPIV3Schema into a JSON Schema (2020-12) and validate with it.

Used by tests/k8s to check RayService / RayCluster manifests offline against the KubeRay v1.7 CRDs in
../shared/k8s-schemas/. Unknown fields are rejected (like `kubectl apply --validate=strict`), so a typo
fails; CEL rules (`x-kubernetes-validations`, only immutability rules in KubeRay) are not evaluated.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA_DIR = Path(__file__).resolve().parents[3] / "shared" / "k8s-schemas"
VENDORED_DIR = Path(__file__).resolve().parent / "crds"  # gzipped copies, for machines without ../shared
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}

INT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
COPIED_KEYS = {"enum", "pattern", "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "required"}
COPIED_KEYS |= {"multipleOf", "uniqueItems", "minProperties", "maxProperties"}
# Keys with no validation meaning offline (docs, defaults, apply strategy, CEL rules we do not evaluate).
IGNORED_KEYS = {"description", "default", "example", "title", "x-kubernetes-map-type", "x-kubernetes-validations"}
HANDLED_KEYS = COPIED_KEYS | IGNORED_KEYS | {
    "type", "properties", "items", "additionalProperties", "anyOf", "allOf", "oneOf", "not", "format",
    "nullable", "exclusiveMinimum", "exclusiveMaximum", "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource", "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}  # fmt: skip


class UnsupportedSchemaError(ValueError):
    """The CRD uses an OpenAPI keyword this converter does not know (so it would be silently ignored)."""


def convert(node: dict[str, Any]) -> dict[str, Any]:
    """One OpenAPI v3 (structural, Kubernetes-flavoured) schema node -> a JSON Schema node."""
    unknown = set(node) - HANDLED_KEYS
    if unknown:
        raise UnsupportedSchemaError(f"unsupported schema keywords {sorted(unknown)}")
    if node.get("x-kubernetes-int-or-string"):
        out = _int_or_string(node)
    else:
        out = {key: node[key] for key in COPIED_KEYS if key in node}
        out.update(_typed(node))
    out.update(_combinators(node))
    out.update(_list_semantics(node))
    if node.get("nullable"):
        _allow_null(out)
    return out


def _typed(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "type" in node:
        out["type"] = node["type"]
    if node.get("format") in INT_BOUNDS:
        low, high = INT_BOUNDS[node["format"]]
        out["minimum"] = max(low, node.get("minimum", low))
        out["maximum"] = min(high, node.get("maximum", high))
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if node.get(flag) is True:  # OpenAPI 3.0 boolean form -> JSON Schema numeric form
            out[flag] = out.pop(bound, node[bound])
    if "items" in node:
        out["items"] = convert(node["items"])
    if "properties" in node or node.get("type") == "object":
        out.update(_object(node))
    return out


def _object(node: dict[str, Any]) -> dict[str, Any]:
    """Properties are closed unless the CRD says otherwise: an unknown (typo'd) field is an error."""
    out: dict[str, Any] = {}
    properties = dict(node.get("properties", {}))
    if node.get("x-kubernetes-embedded-resource"):
        for key in ("apiVersion", "kind"):
            properties.setdefault(key, {"type": "string"})
        properties.setdefault("metadata", {"type": "object", "x-kubernetes-preserve-unknown-fields": True})
    if properties:
        out["properties"] = {name: convert(child) for name, child in properties.items()}
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = convert(extra)
    elif isinstance(extra, bool):
        out["additionalProperties"] = extra
    elif not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _int_or_string(node: dict[str, Any]) -> dict[str, Any]:
    string: dict[str, Any] = {"type": "string"}
    for key in ("pattern", "maxLength", "minLength"):
        if key in node:
            string[key] = node[key]
    return {"anyOf": [{"type": "integer"}, string]}


def _combinators(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node and not node.get("x-kubernetes-int-or-string"):
            out[key] = [convert(branch) for branch in node[key]]
    if "not" in node:
        out["not"] = convert(node["not"])
    return out


def _list_semantics(node: dict[str, Any]) -> dict[str, Any]:
    if node.get("x-kubernetes-list-type") == "set":
        return {"uniqueItems": True}
    if node.get("x-kubernetes-list-type") == "map":
        return {"x-kubernetes-list-map-keys": list(node.get("x-kubernetes-list-map-keys", []))}
    return {}


def _allow_null(out: dict[str, Any]) -> None:
    if "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    elif "anyOf" in out:
        out["anyOf"] = [*out["anyOf"], {"type": "null"}]
    if "enum" in out:
        out["enum"] = [*out["enum"], None]


def _unique_map_keys(
    validator: Any, keys: list[str], instance: Any, schema: dict
) -> Iterator[jsonschema.ValidationError]:
    """`x-kubernetes-list-type: map`: no two items may share the same values of the map keys."""
    if not validator.is_type(instance, "array") or not keys:
        return
    seen: set[tuple] = set()
    for item in instance:
        if not isinstance(item, dict):
            continue
        key = tuple(repr(item.get(name)) for name in keys)
        if key in seen:
            yield jsonschema.ValidationError(f"duplicate entry for map keys {keys}: {item}")
        seen.add(key)


Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, validators={"x-kubernetes-list-map-keys": _unique_map_keys}
)


def crd_json_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    """The JSON Schema of one served version of `crd`, with apiVersion and kind pinned."""
    matches = [v for v in crd["spec"]["versions"] if v["name"] == version and v.get("served", True)]
    if not matches:
        raise KeyError(f"{crd['metadata']['name']} serves no version {version!r}")
    schema = convert(matches[0]["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/{version}"}
    schema["properties"]["kind"] = {"const": crd["spec"]["names"]["kind"]}
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# The API server validates metadata itself (the CRD says only `type: object`); this is the part we use.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
OBJECT_META: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
        "namespace": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}


@cache
def load_crd(kind: str) -> dict[str, Any]:
    """The KubeRay CRD for `kind` from ../shared/k8s-schemas (parsed once per test session)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(crd_text(kind), Loader=loader)


def crd_text(kind: str) -> str:
    """The CRD YAML from ../shared/k8s-schemas when present, else our vendored gzip copy of it."""
    shared = SCHEMA_DIR / CRD_FILES[kind]
    if shared.exists():
        return shared.read_text()
    return gzip.decompress((VENDORED_DIR / f"{CRD_FILES[kind]}.gz").read_bytes()).decode()


@cache
def validator_for(kind: str, version: str = "v1") -> Any:
    """A jsonschema validator for one KubeRay kind (RayService or RayCluster)."""
    schema = crd_json_schema(load_crd(kind), version)
    Validator.check_schema(schema)
    return Validator(schema)


def crd_errors(manifest: dict[str, Any]) -> list[str]:
    """Every schema violation in a KubeRay manifest, as 'path: message' lines (empty = valid)."""
    version = manifest.get("apiVersion", "/").split("/")[-1]
    try:
        validator = validator_for(manifest["kind"], version)
    except KeyError as exc:
        return [f"apiVersion: {exc.args[0]}"]
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]

"""The CRD -> JSON Schema converter: Kubernetes extensions, closed objects, and both KubeRay CRDs."""

from __future__ import annotations

import pytest

from tests.k8s.crd_schema import UnsupportedSchemaError, Validator, convert, crd_errors


def _valid(node: dict, instance: object) -> bool:
    return Validator(convert(node)).is_valid(instance)


def test_int_or_string_accepts_both_and_keeps_the_string_pattern() -> None:
    node = {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "pattern": "^[0-9]+m?$",
    }
    assert _valid(node, 8) and _valid(node, "500m")
    assert not _valid(node, "eight") and not _valid(node, 1.5) and not _valid(node, None)


def test_nullable_allows_null() -> None:
    assert _valid({"type": "string", "nullable": True}, None)
    assert not _valid({"type": "string"}, None)


def test_objects_are_closed_unless_preserving_unknown_fields() -> None:
    closed = {"type": "object", "properties": {"name": {"type": "string"}}}
    assert _valid(closed, {"name": "a"}) and not _valid(closed, {"nmae": "a"})
    open_node = {**closed, "x-kubernetes-preserve-unknown-fields": True}
    assert _valid(open_node, {"anything": [1, 2]})


def test_additional_properties_schema_is_converted() -> None:
    node = {"type": "object", "additionalProperties": {"type": "string"}}
    assert _valid(node, {"num-cpus": "0"}) and not _valid(node, {"num-cpus": 0})


def test_list_map_keys_must_be_unique() -> None:
    node = {
        "type": "array",
        "items": {"type": "object", "properties": {"name": {"type": "string"}, "port": {"type": "integer"}}},
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    }
    assert _valid(node, [{"name": "a", "port": 1}, {"name": "b", "port": 1}])
    assert not _valid(node, [{"name": "a", "port": 1}, {"name": "a", "port": 2}])


def test_set_lists_are_unique_and_int32_is_bounded() -> None:
    assert not _valid({"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"}, ["a", "a"])
    assert not _valid({"type": "integer", "format": "int32"}, 2**31)


def test_unknown_openapi_keyword_is_refused() -> None:
    with pytest.raises(UnsupportedSchemaError, match="discriminator"):
        convert({"type": "object", "discriminator": {"propertyName": "kind"}})


@pytest.mark.parametrize(("kind", "required"), [("RayService", "rayClusterConfig"), ("RayCluster", "headGroupSpec")])
def test_kuberay_crds_convert_to_working_json_schemas(kind: str, required: str) -> None:
    base = {"apiVersion": "ray.io/v1", "kind": kind, "metadata": {"name": "x"}}
    assert crd_errors({**base, "spek": {}}) == ["<root>: Additional properties are not allowed ('spek' was unexpected)"]
    assert crd_errors({**base, "spec": {}}) == [f"spec: '{required}' is a required property"]
    assert crd_errors({**base, "apiVersion": "ray.io/v2"}) != []


@pytest.mark.parametrize("kind", ["RayService", "RayCluster"])
def test_vendored_crds_match_shared_copy(kind):
    """The gzipped CRDs in tests/k8s/crds are byte-for-byte the ones in ../shared (when that exists)."""
    import gzip

    from tests.k8s.crd_schema import CRD_FILES, SCHEMA_DIR, VENDORED_DIR

    shared = SCHEMA_DIR / CRD_FILES[kind]
    if not shared.exists():
        pytest.skip("../shared/k8s-schemas is not on this machine")
    assert gzip.decompress((VENDORED_DIR / f"{CRD_FILES[kind]}.gz").read_bytes()) == shared.read_bytes()

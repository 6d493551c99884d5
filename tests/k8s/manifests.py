"""Shared helpers for tests/k8s: render the overlays, find objects, validate each kind offline.

RayService / RayCluster go through the KubeRay CRD schemas (crd_schema.py), built-in kinds through
`kubernetes-validate` (strict), and PodMonitor through a hand-written subset of the Prometheus Operator's
monitoring.coreos.com/v1 schema (its CRD is not in ../shared/k8s-schemas).
"""

from __future__ import annotations

import copy
import json
import shlex
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests.k8s import kustomize_lite
from tests.k8s.crd_schema import crd_errors

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "k8s"
OVERLAY_CONFIGS = {
    "dev-cpu": "deployments/configs/cpu.yaml",
    "prod-gpu": "deployments/configs/gpu.yaml",
    "prod-gpu-cosyvoice2": "deployments/configs/gpu-cosyvoice2.yaml",
}
PROD_OVERLAYS = ("prod-gpu", "prod-gpu-cosyvoice2")
KUBERNETES_VERSION = "1.33"


@cache
def _rendered(directory: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize_lite.render(K8S_DIR / directory))


def render(directory: str) -> list[dict[str, Any]]:
    """Objects of a kustomization under k8s/ (e.g. "overlays/prod-gpu"), as fresh copies."""
    return copy.deepcopy(list(_rendered(directory)))


def find(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The single object of `kind` in `objects`."""
    matches = [obj for obj in objects if obj["kind"] == kind]
    if len(matches) != 1:
        raise LookupError(f"expected one {kind}, found {len(matches)}")
    return matches[0]


def standalone_manifests() -> list[tuple[str, dict[str, Any]]]:
    """Objects in k8s/models/*.yaml (applied with `kubectl apply -f`, not through an overlay)."""
    return [
        (path.name, doc)
        for path in sorted((K8S_DIR / "models").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def builtin_errors(obj: dict[str, Any]) -> list[str]:
    """kubernetes-validate (strict: unknown fields fail) against the bundled Kubernetes schemas."""
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(str(p) for p in exc.path)}: {exc.message}"]
    return []


_STRINGS = {"type": "array", "items": {"type": "string"}}
_RELABELING = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": _STRINGS,
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {"enum": ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep"]},
    },
}
POD_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "podTargetLabels": _STRINGS,
                "namespaceSelector": {"type": "object"},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {"type": "array"},
                    },
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h))+)$"},
                            "scrapeTimeout": {"type": "string"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array", "items": _RELABELING},
                            "metricRelabelings": {"type": "array", "items": _RELABELING},
                        },
                    },
                },
            },
        },
    },
}


def pod_monitor_errors(obj: dict[str, Any]) -> list[str]:
    """The PodMonitor against the hand-written subset schema above."""
    validator = jsonschema.Draft202012Validator(POD_MONITOR_SCHEMA)
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]


def manifest_errors(obj: dict[str, Any]) -> list[str]:
    """Validate any object we ship; an object of a kind we have no validator for is itself an error."""
    if obj["kind"] in ("RayService", "RayCluster"):
        return crd_errors(obj)
    if obj["kind"] == "PodMonitor":
        return pod_monitor_errors(obj)
    if obj["apiVersion"] in ("v1", "apps/v1", "batch/v1", "networking.k8s.io/v1"):
        return builtin_errors(obj)
    return [f"no offline validator for {obj['apiVersion']} {obj['kind']}"]


def raycluster_from(rayservice: dict[str, Any]) -> dict[str, Any]:
    """The RayCluster KubeRay creates from a RayService's rayClusterConfig (for the RayCluster CRD)."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": f"{rayservice['metadata']['name']}-raycluster"},
        "spec": copy.deepcopy(rayservice["spec"]["rayClusterConfig"]),
    }


def pod_templates(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod templates by group: "head" and each worker groupName."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster.get("workerGroupSpecs", []):
        templates[group["groupName"]] = group["template"]
    return templates


def worker_groups(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Worker group specs by groupName."""
    return {group["groupName"]: group for group in rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs", [])}


def ray_container(template: dict[str, Any]) -> dict[str, Any]:
    """The Ray container (KubeRay runs Ray in the first container of a pod template)."""
    return template["spec"]["containers"][0]


def start_param_resources(group: dict[str, Any]) -> dict[str, float]:
    """Custom resources a group advertises, parsed as `ray start --resources=...` would after the shell."""
    value = group.get("rayStartParams", {}).get("resources")
    if value is None:
        return {}
    (argument,) = shlex.split(f"--resources={value}")
    return json.loads(argument.removeprefix("--resources="))


def quantity(value: str | int) -> float:
    """A plain Kubernetes CPU / GPU quantity ("8", 1, "500m") as a number."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)

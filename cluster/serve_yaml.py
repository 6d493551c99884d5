"""Generate Ray Serve configs (`serve deploy` files, KubeRay `serveConfigV2`) from one ServeConfig.

`python -m cluster.serve_yaml CONFIG.yaml` prints the Serve config; `--write` regenerates the committed
files in `GENERATED` (deployments/serve_*.yaml and the k8s overlays' serveConfigV2 patches) and `--check`
fails when they drift. tests/k8s validates the output with Ray's ServeDeploySchema.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from core.config import (
    GRACEFUL_WAIT_LOOP_S,
    ServeConfig,
    StageDeploymentConfig,
    http_proxy_options,
    load_serve_config,
)
from deployments.autoscaling import autoscaling_config
from deployments.model_plan import plan_models

IMPORT_PATH = "deployments.app:app_builder"
# HTTP proxies on the head only: the head pod is then the one KubeRay puts behind voxray-serve-svc, and
# the Router replicas (gRPC servers) are pinned to it by the head's `voxray_router` resource.
PROXY_LOCATION = "HeadOnly"
REPO_ROOT = Path(__file__).resolve().parent.parent


def _stage_deployment(name: str, stage: StageDeploymentConfig, graceful_timeout_s: float, kind: str | None) -> dict:
    """One Serve deployment entry: replicas or autoscaling, concurrency cap, actor resources, graceful stop."""
    actor_options: dict = {"num_cpus": stage.num_cpus, "num_gpus": stage.num_gpus}
    if stage.resources:
        actor_options["resources"] = dict(stage.resources)
    entry: dict = {"name": name}
    if stage.autoscaling:
        entry["autoscaling_config"] = autoscaling_config(stage.model_dump(mode="json"), kind)
    else:
        entry["num_replicas"] = stage.num_replicas
    entry["max_ongoing_requests"] = stage.max_ongoing_requests
    entry["ray_actor_options"] = actor_options
    entry["graceful_shutdown_timeout_s"] = graceful_timeout_s
    entry["graceful_shutdown_wait_loop_s"] = GRACEFUL_WAIT_LOOP_S
    entry["health_check_period_s"] = stage.health_check_period_s
    return entry


def _deployments(config: ServeConfig) -> list[dict]:
    """The Router, then each served model's LLMStage and (once per shared detokenizer) its DetokStage."""
    graceful_s = config.drain.serve_graceful_timeout_s
    entries, named = [_stage_deployment("Router", config.router, graceful_s, None)], {"Router"}
    for served in plan_models(config):
        stages = ((served.llm_deployment, served.view.llm, "llm"),
                  (served.detok_deployment, served.view.detok, "detok"))  # fmt: skip
        for name, stage, kind in stages:
            if name not in named:
                entries.append(_stage_deployment(name, stage, graceful_s, kind))
                named.add(name)
    return entries


def serve_schema_dict(config: ServeConfig) -> dict:
    """The Serve multi-app config for `config` (what `ServeDeploySchema` and serveConfigV2 accept)."""
    application = {
        "name": config.app_name,
        "route_prefix": config.route_prefix,
        "import_path": IMPORT_PATH,
        "args": config.model_dump(mode="json", exclude=None if config.models else {"models"}),  # (one model: as before)
        "deployments": _deployments(config),
    }
    return {
        "proxy_location": PROXY_LOCATION,
        "http_options": http_proxy_options(config),  # no grpc_options: the Router replicas serve gRPC
        "applications": [application],
    }


class _LiteralDumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings as `|` blocks (readable serveConfigV2)."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralDumper.add_representer(str, _str_representer)


def _dump(data: object) -> str:
    return yaml.dump(data, Dumper=_LiteralDumper, sort_keys=False, default_flow_style=False, width=120)


def render_serve_yaml(config: ServeConfig) -> str:
    """The Serve config as YAML text (also the exact serveConfigV2 string in the k8s manifests)."""
    return _dump(serve_schema_dict(config))


def render_rayservice_patch(config: ServeConfig) -> str:
    """A kustomize JSON6902 patch that sets a RayService's spec.serveConfigV2 to `render_serve_yaml`."""
    return _dump([{"op": "add", "path": "/spec/serveConfigV2", "value": render_serve_yaml(config)}])


@dataclass(frozen=True)
class GeneratedFile:
    """A committed file rendered from a ServeConfig YAML (paths relative to the repo root)."""

    source: str
    target: str
    kind: str  # "serve" (Serve config file) or "rayservice-patch" (kustomize JSON6902 patch)


GENERATED: tuple[GeneratedFile, ...] = (
    GeneratedFile("deployments/configs/cpu.yaml", "deployments/serve_cpu.yaml", "serve"),
    GeneratedFile("deployments/configs/gpu.yaml", "deployments/serve_gpu.yaml", "serve"),
    GeneratedFile("deployments/configs/gpu-1.yaml", "deployments/serve_gpu_1.yaml", "serve"),  # one machine, no k8s
    GeneratedFile("deployments/configs/cpu.yaml", "k8s/overlays/dev-cpu/serve-config.patch.yaml", "rayservice-patch"),
    GeneratedFile("deployments/configs/gpu.yaml", "k8s/overlays/prod-gpu/serve-config.patch.yaml", "rayservice-patch"),
    GeneratedFile("deployments/configs/gpu-cosyvoice2.yaml", "deployments/serve_gpu_cosyvoice2.yaml", "serve"),
    GeneratedFile("deployments/configs/multi-model.yaml", "deployments/serve_multi_model.yaml", "serve"),
    GeneratedFile(
        "deployments/configs/gpu-cosyvoice2.yaml",
        "k8s/overlays/prod-gpu-cosyvoice2/serve-config.patch.yaml",
        "rayservice-patch",
    ),
)


def expected_text(item: GeneratedFile, root: Path = REPO_ROOT) -> str:
    """What the committed file `item.target` must contain: a header naming its source, then the render."""
    config = load_serve_config(root / item.source, check_files=False)  # TLS files live in the pods
    body = render_serve_yaml(config) if item.kind == "serve" else render_rayservice_patch(config)
    header = f"# Generated from {item.source} by `python -m cluster.serve_yaml --write`; do not edit.\n"
    return header + body


def drifted_files(root: Path = REPO_ROOT) -> list[str]:
    """Targets in GENERATED whose committed text differs from what the generator produces now."""
    stale = []
    for item in GENERATED:
        path = root / item.target
        if not path.exists() or path.read_text() != expected_text(item, root):
            stale.append(item.target)
    return stale


def write_generated(root: Path = REPO_ROOT) -> list[str]:
    """Rewrite every target in GENERATED; returns the paths written."""
    for item in GENERATED:
        (root / item.target).write_text(expected_text(item, root))
    return [item.target for item in GENERATED]


def main(argv: list[str] | None = None) -> int:
    """CLI: print one config's Serve YAML, or write / check the committed generated files."""
    parser = argparse.ArgumentParser(prog="python -m cluster.serve_yaml", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, help="ServeConfig YAML (what `voxray serve --config` takes)")
    parser.add_argument("--rayservice-patch", action="store_true", help="print a serveConfigV2 JSON6902 patch")
    parser.add_argument("--write", action="store_true", help="regenerate the committed files listed in GENERATED")
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed generated file drifted")
    args = parser.parse_args(argv)
    if args.write:
        print("\n".join(f"wrote {path}" for path in write_generated()))
        return 0
    if args.check:
        stale = drifted_files()
        print("\n".join(f"stale: {path}" for path in stale) or "generated files are up to date")
        return 1 if stale else 0
    if args.config is None:
        parser.error("give a CONFIG.yaml, --write or --check")
    config = load_serve_config(args.config, check_files=False)
    sys.stdout.write(render_rayservice_patch(config) if args.rayservice_patch else render_serve_yaml(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())

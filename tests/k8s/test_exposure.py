"""What the k8s manifests expose: the public Service carries only HTTP and gRPC (to the head, where the
proxy and the Routers run), Ray's own ports stay internal, the configs bind all interfaces, and the prod
overlay's gRPC TLS comes from a mounted Secret the config points at."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from core.config import load_serve_config
from tests.k8s.manifests import OVERLAY_CONFIGS, REPO_ROOT, find, pod_templates, ray_container, render
from tests.k8s.serve_checks import parse_serve_config_v2

OVERLAYS = sorted(OVERLAY_CONFIGS)
RAY_PORTS = {6379, 8265, 10001, 8080, 52365}  # GCS, dashboard, Ray client, metrics, dashboard agent
HEAD_RESOURCE = "node:__internal_head__"


def _objects(overlay: str) -> list[dict]:
    return render(f"overlays/{overlay}")


def _config(overlay: str):
    return load_serve_config(REPO_ROOT / OVERLAY_CONFIGS[overlay], check_files=False)


def _services(overlay: str) -> list[dict]:
    return [obj for obj in _objects(overlay) if obj["kind"] == "Service"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_public_service_exposes_only_http_and_grpc(overlay: str) -> None:
    config = _config(overlay)
    (public,) = [s for s in _services(overlay) if s["metadata"]["name"] == "voxray-public"]
    ports = {(p["port"], p["targetPort"]) for p in public["spec"]["ports"]}
    assert ports == {(config.http_port, "serve"), (config.grpc_port, "serve-grpc")}
    head = pod_templates(find(_objects(overlay), "RayService"))["head"]
    container_ports = {p["name"]: p["containerPort"] for p in ray_container(head)["ports"]}
    assert (container_ports["serve"], container_ports["serve-grpc"]) == (config.http_port, config.grpc_port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_public_service_selects_the_head_only(overlay: str) -> None:
    (public,) = _services(overlay)
    selector = dict(public["spec"]["selector"])
    assert selector.pop("ray.io/serve") == "true"  # KubeRay's label of a head whose proxy is healthy
    for group, template in pod_templates(find(_objects(overlay), "RayService")).items():
        labels = template["metadata"]["labels"]
        assert (selector.items() <= labels.items()) == (group == "head"), group


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_service_we_ship_carries_a_ray_port(overlay: str) -> None:
    for service in _services(overlay):
        ports = service["spec"]["ports"]
        numbers = {p["port"] for p in ports} | {p.get("targetPort") for p in ports}
        assert not numbers & RAY_PORTS, service["metadata"]["name"]
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"  # public by choice, behind a gateway


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_proxy_and_routers_run_on_the_head(overlay: str) -> None:
    serve = parse_serve_config_v2(find(_objects(overlay), "RayService")["spec"]["serveConfigV2"])
    assert serve["proxy_location"] == "HeadOnly" and "grpc_options" not in serve
    [router] = [d for d in serve["applications"][0]["deployments"] if d["name"] == "Router"]
    assert router["ray_actor_options"]["resources"][HEAD_RESOURCE] > 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_are_ready_without_a_serve_proxy(overlay: str) -> None:
    for group, template in pod_templates(find(_objects(overlay), "RayService")).items():
        if group == "head":
            continue
        command = " ".join(ray_container(template)["readinessProbe"]["exec"]["command"])
        assert "local_raylet_healthz" in command and "-/healthz" not in command, group


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_configs_bind_all_interfaces_and_hide_docs(overlay: str) -> None:
    config = _config(overlay)
    assert (config.http_host, config.grpc_host) == ("0.0.0.0", "0.0.0.0")
    assert not config.http_docs and not config.grpc_reflection


@pytest.mark.parametrize("overlay", ["prod-gpu", "prod-gpu-cosyvoice2"])
def test_prod_grpc_tls_comes_from_the_mounted_secret(overlay: str) -> None:
    config = _config(overlay)
    assert config.tls.enabled and not config.tls.http_proxy  # HTTPS at the gateway: KubeRay probes plain HTTP
    head = pod_templates(find(_objects(overlay), "RayService"))["head"]
    volumes = {v["name"]: v for v in head["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in ray_container(head)["volumeMounts"]}
    for path in (config.tls.cert_file, config.tls.key_file):
        mount = mounts[str(PurePosixPath(path).parent)]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"]["secretName"] == "voxray-tls"
        assert PurePosixPath(path).name in ("tls.crt", "tls.key")  # the keys of a kubernetes.io/tls Secret

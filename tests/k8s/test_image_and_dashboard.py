"""k8s/Dockerfile installs the whole project on the official Ray image; the Grafana dashboard plots our metrics."""

from __future__ import annotations

import json
import re

import ray
import tomllib

from tests.k8s.manifests import K8S_DIR, REPO_ROOT

# Metric names as the team exports them through ray.serve.metrics; Prometheus sees them with a `ray_` prefix.
HISTOGRAMS = ["voxray_ttfa_seconds", "voxray_chunk_underrun_seconds", "voxray_batch_size"]
COUNTERS = ["voxray_stream_viable_total", "voxray_audio_seconds_total", "voxray_admission_rejections_total",
            "voxray_autoscale_decisions_total"]  # fmt: skip
GAUGES = ["voxray_realtime_factor", "voxray_queue_depth", "voxray_active_streams", "voxray_kv_slots_used",
          "voxray_autoscale_target_replicas", "voxray_autoscale_pressure"]  # fmt: skip


def _dockerfile() -> str:
    return (K8S_DIR / "Dockerfile").read_text()


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_image_is_the_official_ray_image_of_our_ray_version() -> None:
    text = _dockerfile()
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_IMAGE_TAG\}$", text, re.M)
    assert f"ARG RAY_IMAGE_TAG={ray.__version__}-py311-cpu" in text


def test_image_installs_every_package_of_the_project() -> None:
    text = _dockerfile()
    assert "pip install --no-cache-dir ." in text
    packages = [name.rstrip("*") for name in _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]]
    for package in packages:
        assert f"COPY --chown=ray:users {package} ./{package}" in text, f"{package} is not copied into the image"


def test_image_torch_matches_the_project_pin() -> None:
    (pin,) = [dep for dep in _pyproject()["project"]["dependencies"] if dep.startswith("torch==")]
    assert f"ARG TORCH_VERSION={pin.removeprefix('torch==')}" in _dockerfile()


def test_image_ships_and_fetches_no_weights() -> None:
    text = _dockerfile().lower()
    for word in ("huggingface-cli", "snapshot_download", "wget", "curl", "hf_hub_download", "git lfs"):
        assert word not in text
    assert "hf_hub_offline=1" in text


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((K8S_DIR / "monitoring/grafana-dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def test_dashboard_plots_every_voxray_metric_with_its_prometheus_name() -> None:
    text = "\n".join(_dashboard_exprs())
    for name in HISTOGRAMS:
        assert f"ray_{name}_bucket" in text or f"ray_{name}_sum" in text, name
    for name in COUNTERS:
        assert f"rate(ray_{name}[" in text, name
    for name in GAUGES:
        assert f"ray_{name})" in text, name
    assert not re.search(r"(?<!ray_)\bvoxray_", text), "every VoxRay series carries Ray's ray_ prefix"


def test_dashboard_panels_are_well_formed() -> None:
    dashboard = json.loads((K8S_DIR / "monitoring/grafana-dashboard.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "voxray-serving"
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}

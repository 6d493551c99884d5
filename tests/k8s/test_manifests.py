"""The k8s/ manifests, rendered offline: schema-valid, one source of truth for Serve, GPU steering and ports."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import ray
import yaml

from cluster.serve_yaml import serve_schema_dict
from core.config import load_serve_config
from llm_stage.registry import get_entry
from tests.k8s import kustomize_lite
from tests.k8s.crd_schema import crd_errors
from tests.k8s.manifests import (
    K8S_DIR,
    OVERLAY_CONFIGS,
    PROD_OVERLAYS,
    REPO_ROOT,
    builtin_errors,
    find,
    manifest_errors,
    pod_monitor_errors,
    pod_templates,
    quantity,
    ray_container,
    raycluster_from,
    render,
    standalone_manifests,
    start_param_resources,
    worker_groups,
)
from tests.k8s.serve_checks import parse_serve_config_v2, serve_config_errors

OVERLAYS = sorted(OVERLAY_CONFIGS)
GPU = "nvidia.com/gpu"


def _rayservice(overlay: str) -> dict:
    return find(render(f"overlays/{overlay}"), "RayService")


def _serve(overlay: str) -> dict:
    return parse_serve_config_v2(_rayservice(overlay)["spec"]["serveConfigV2"])


@pytest.mark.parametrize("directory", ["base", "monitoring", *(f"overlays/{o}" for o in OVERLAYS)])
def test_every_rendered_object_is_valid(directory: str) -> None:
    for obj in render(directory):
        assert manifest_errors(obj) == [], f"{directory}: {obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("name_and_obj", standalone_manifests(), ids=lambda item: item[0])
def test_standalone_manifests_are_valid(name_and_obj: tuple[str, dict]) -> None:
    assert manifest_errors(name_and_obj[1]) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_cluster_config_is_a_valid_raycluster(overlay: str) -> None:
    assert crd_errors(raycluster_from(_rayservice(overlay))) == []


def test_overlays_emit_the_expected_objects() -> None:
    kinds = {overlay: sorted(obj["kind"] for obj in render(f"overlays/{overlay}")) for overlay in OVERLAYS}
    expected_prod = ["ConfigMap", "PodMonitor", "RayService", "Service"]
    assert kinds == {"dev-cpu": ["RayService", "Service"], **{overlay: expected_prod for overlay in PROD_OVERLAYS}}
    for overlay in PROD_OVERLAYS:
        assert {obj["metadata"]["namespace"] for obj in render(f"overlays/{overlay}")} == {"voxray"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_config_v2_is_generated_from_the_serve_config(overlay: str) -> None:
    serve = _serve(overlay)
    assert serve_config_errors(serve) == []
    assert serve == serve_schema_dict(load_serve_config(REPO_ROOT / OVERLAY_CONFIGS[overlay], check_files=False))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_versions_agree(overlay: str) -> None:
    assert _rayservice(overlay)["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    assert f'"ray[serve]=={ray.__version__}"' in (REPO_ROOT / "pyproject.toml").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_head_serves_http_and_grpc_and_every_pod_exports_metrics(overlay: str) -> None:
    config = load_serve_config(REPO_ROOT / OVERLAY_CONFIGS[overlay], check_files=False)
    for group, template in pod_templates(_rayservice(overlay)).items():
        ports = {p["name"]: p["containerPort"] for p in ray_container(template)["ports"]}
        assert ports["metrics"] == 8080, group
        if group == "head":
            expected = (config.http_port, config.grpc_port, 8265)
            assert (ports["serve"], ports["serve-grpc"], ports["dashboard"]) == expected
        else:  # no proxy and no Router there (HeadOnly, Routers pinned to the head)
            assert not {"serve", "serve-grpc"} & ports.keys(), group


@pytest.mark.parametrize("overlay", PROD_OVERLAYS)
def test_prod_head_does_no_gpu_work(overlay: str) -> None:
    head = _rayservice(overlay)["spec"]["rayClusterConfig"]["headGroupSpec"]
    config = load_serve_config(REPO_ROOT / OVERLAY_CONFIGS[overlay], check_files=False)
    assert float(head["rayStartParams"]["num-cpus"]) == config.router.num_replicas * config.router.num_cpus
    resources = ray_container(head["template"])["resources"]
    assert GPU not in resources.get("limits", {}) and GPU not in resources.get("requests", {})
    assert "tolerations" not in head["template"]["spec"]


@pytest.mark.parametrize("overlay", PROD_OVERLAYS)
def test_prod_stages_are_steered_to_their_own_gpu_group(overlay: str) -> None:
    groups = worker_groups(_rayservice(overlay))
    assert set(groups) == {"llm-gpu", "detok-gpu"}
    serve = _serve(overlay)
    for deployment in serve["applications"][0]["deployments"]:
        custom = deployment["ray_actor_options"].get("resources", {})
        if deployment["ray_actor_options"]["num_gpus"] == 0:
            continue
        assert custom, f"{deployment['name']} uses a GPU but names no worker group resource"
        providers = [name for name, group in groups.items() if custom.items() <= start_param_resources(group).items()]
        assert len(providers) == 1, f"{deployment['name']} must match exactly one group, got {providers}"
        group = groups[providers[0]]
        container = ray_container(group["template"])
        gpus_per_pod = quantity(container["resources"]["limits"][GPU])
        assert gpus_per_pod >= deployment["ray_actor_options"]["num_gpus"]
        replicas_per_pod = min(start_param_resources(group)[k] / v for k, v in custom.items())
        autoscaling = deployment.get("autoscaling_config")
        max_replicas = autoscaling["max_replicas"] if autoscaling else deployment["num_replicas"]
        assert group["maxReplicas"] * replicas_per_pod >= max_replicas, f"{providers[0]} cannot host max_replicas"
        assert group["template"]["spec"]["nodeSelector"], f"{providers[0]} has no node selector"


def test_prod_gpu_scales_stages_on_their_slo_and_pods_with_the_ray_autoscaler() -> None:
    """Serve's controller runs the SLO policy per stage (deployments.autoscaling); the KubeRay autoscaler
    then adds and removes worker pods between each group's minReplicas and maxReplicas."""
    rayservice = _rayservice("prod-gpu")
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    groups = worker_groups(rayservice)
    assert all(group["maxReplicas"] > group["minReplicas"] for group in groups.values())
    by_name = {d["name"]: d for d in _serve("prod-gpu")["applications"][0]["deployments"]}
    for name, stage in (("LLMStage", "llm"), ("DetokStage", "detok")):
        autoscaling = by_name[name]["autoscaling_config"]
        assert autoscaling["policy"]["policy_function"] == "deployments.autoscaling:SLOAutoscalingPolicy"
        assert autoscaling["policy"]["policy_kwargs"]["stage"] == stage
        assert autoscaling["upscale_delay_s"] == autoscaling["downscale_delay_s"] == 0  # the policy's cool-downs


@pytest.mark.parametrize("overlay", PROD_OVERLAYS)
def test_prod_models_come_read_only_from_the_pvc(overlay: str) -> None:
    config = load_serve_config(REPO_ROOT / OVERLAY_CONFIGS[overlay], check_files=False)
    (pvc_name,) = [
        obj["metadata"]["name"] for _, obj in standalone_manifests() if obj["kind"] == "PersistentVolumeClaim"
    ]
    for group, template in pod_templates(_rayservice(overlay)).items():
        if group == "head":
            continue
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (mount,) = [m for m in ray_container(template)["volumeMounts"] if m["mountPath"] == "/models"]
        assert mount["readOnly"] is True
        claim = volumes[mount["name"]]["persistentVolumeClaim"]
        assert claim == {"claimName": pvc_name, "readOnly": True}
        paths = (config.engine.model.checkpoint_dir, config.engine.model.codec_dir)
        assert paths[0] is not None
        for path in (p for p in paths if p is not None):  # cosyvoice2: the codec is in the checkpoint
            assert str(path).startswith(mount["mountPath"] + "/"), f"{path} is not on the models volume"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_never_download_weights(overlay: str) -> None:
    for group, template in pod_templates(_rayservice(overlay)).items():
        spec = template["spec"]
        # the only init container: the prod head's API keys check (it reads a mounted file, fetches nothing)
        expected = ["check-api-keys"] if (overlay in PROD_OVERLAYS and group == "head") else []
        assert [c["name"] for c in spec.get("initContainers", [])] == expected, group
        container = ray_container(template)
        assert "command" not in container and "args" not in container, group
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1", group


@pytest.mark.parametrize("overlay", PROD_OVERLAYS)
def test_prod_gpu_workers_document_cross_node_nccl(overlay: str) -> None:
    for group, template in pod_templates(_rayservice(overlay)).items():
        if group == "head":
            continue
        env = {e["name"]: e.get("value") for e in ray_container(template)["env"]}
        assert {"NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "GLOO_SOCKET_IFNAME"} <= env.keys(), group
    patch_text = (K8S_DIR / "overlays/prod-gpu/worker-groups.patch.yaml").read_text()
    assert "NCCL_IB_HCA" in patch_text, "the RDMA alternative is documented next to the settings"


def test_pod_monitor_scrapes_every_ray_pod() -> None:
    objects = render("overlays/prod-gpu")
    monitor = find(objects, "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    kuberay_labels = {"ray.io/is-ray-node": "yes"}  # set by KubeRay on every Ray pod
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    for group, template in pod_templates(find(objects, "RayService")).items():
        labels = {**kuberay_labels, **template["metadata"]["labels"]}
        assert selector.items() <= labels.items(), group
        assert port in {p["name"] for p in ray_container(template)["ports"]}, group


def test_dashboard_config_map_embeds_the_dashboard_file() -> None:
    config_map = find(render("overlays/prod-gpu"), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = (K8S_DIR / "monitoring/grafana-dashboard.json").read_text()
    assert config_map["data"] == {"grafana-dashboard.json": dashboard}
    assert len(dashboard.encode()) < 1024 * 1024, "ConfigMaps are limited to 1 MiB"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) not installed")
@pytest.mark.parametrize("directory", ["monitoring", *(f"overlays/{o}" for o in OVERLAYS)])
def test_renderer_matches_kubectl_kustomize(directory: str) -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S_DIR / directory)], capture_output=True, text=True, timeout=60, check=True
    )
    key = lambda obj: (obj["kind"], obj["metadata"]["name"])  # noqa: E731
    expected = sorted((doc for doc in yaml.safe_load_all(result.stdout) if doc), key=key)
    assert sorted(render(directory), key=key) == expected


# Negative tests: a typo anywhere fails validation.


def test_typo_in_a_worker_group_field_fails() -> None:
    rayservice = _rayservice("prod-gpu")
    group = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["minReplica"] = group.pop("minReplicas")
    errors = crd_errors(rayservice)
    assert any("minReplica'" in e and "not allowed" in e for e in errors), errors
    assert any("'minReplicas' is a required property" in e for e in errors), errors


def test_typo_in_a_pod_template_fails() -> None:
    rayservice = _rayservice("dev-cpu")
    container = ray_container(rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])
    container["imagePullPolicyy"] = "Always"
    assert any("imagePullPolicyy" in e for e in crd_errors(rayservice))


def test_wrong_type_in_ray_start_params_fails() -> None:
    rayservice = _rayservice("prod-gpu")
    rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert any("rayStartParams.num-cpus" in e for e in crd_errors(rayservice))


def test_duplicate_container_port_fails() -> None:
    rayservice = _rayservice("dev-cpu")
    container = ray_container(rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])
    container["ports"].append({"name": "serve-again", "containerPort": 8000})
    assert any("duplicate entry" in e for e in crd_errors(rayservice))


def test_typo_in_serve_config_v2_fails() -> None:
    text = _rayservice("prod-gpu")["spec"]["serveConfigV2"].replace("max_ongoing_requests:", "max_ongoing_request:", 1)
    assert serve_config_errors(parse_serve_config_v2(text)) != []


def test_typo_in_a_builtin_kind_fails() -> None:
    config_map = find(render("overlays/prod-gpu"), "ConfigMap")
    config_map["dta"] = config_map.pop("data")
    assert builtin_errors(config_map) != []


def test_typo_in_the_pod_monitor_fails() -> None:
    monitor = find(render("overlays/prod-gpu"), "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert pod_monitor_errors(monitor) != []


def test_cosyvoice2_overlay_runs_one_llm_and_three_detok_gpus_with_the_family_schedule() -> None:
    rayservice = _rayservice("prod-gpu-cosyvoice2")
    groups = worker_groups(rayservice)
    sizes = {name: (g["replicas"], g["minReplicas"], g["maxReplicas"]) for name, g in groups.items()}
    assert sizes == {"llm-gpu": (1, 1, 1), "detok-gpu": (3, 3, 3)}
    deployments = {d["name"]: d for d in _serve("prod-gpu-cosyvoice2")["applications"][0]["deployments"]}
    assert (deployments["LLMStage"]["num_replicas"], deployments["DetokStage"]["num_replicas"]) == (1, 3)
    config = load_serve_config(REPO_ROOT / OVERLAY_CONFIGS["prod-gpu-cosyvoice2"], check_files=False)
    entry = get_entry(config.engine.model.name)
    assert entry.family.name == "cosyvoice2" and config.engine.model.codec_dir is None
    schedule = entry.chunk_schedule(config.engine)  # refused here if the detokenizer could not stream it
    assert (schedule.chunk_frames, schedule.right_context_frames) == (25, 3)
    # everything else is prod-gpu's: the head (TLS, Routers), monitoring, the models volume
    prod = _rayservice("prod-gpu")["spec"]["rayClusterConfig"]
    assert rayservice["spec"]["rayClusterConfig"]["headGroupSpec"] == prod["headGroupSpec"]


def test_a_failed_json6902_test_op_fails_the_render(tmp_path) -> None:
    doc = {"spec": {"groups": [{"name": "llm-gpu"}]}}
    kustomize_lite.apply_operation(doc, {"op": "test", "path": "/spec/groups/0/name", "value": "llm-gpu"})
    with pytest.raises(ValueError, match="test failed"):
        kustomize_lite.apply_operation(doc, {"op": "test", "path": "/spec/groups/0/name", "value": "detok-gpu"})


def test_renderer_refuses_kustomize_features_it_does_not_implement(tmp_path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(kustomize_lite.UnsupportedKustomizationError, match="namePrefix"):
        kustomize_lite.render(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shutdown_settings_fit_together(overlay: str) -> None:
    """A stopping pod: the head's preStop drains with the config's grace and a worker's moves its
    LLM streams out, Serve's graceful timeout covers the drain, and every pod's
    terminationGracePeriodSeconds covers both (else Kubernetes kills streams still being ended)."""
    config = load_serve_config(REPO_ROOT / OVERLAY_CONFIGS[overlay], check_files=False)
    graceful_s = {entry["graceful_shutdown_timeout_s"] for entry in _serve(overlay)["applications"][0]["deployments"]}
    assert graceful_s == {config.drain.serve_graceful_timeout_s} and min(graceful_s) > config.drain.grace_s
    for group, template in pod_templates(_rayservice(overlay)).items():
        grace_period_s = template["spec"]["terminationGracePeriodSeconds"]
        assert grace_period_s > max(graceful_s), group
        command = ray_container(template)["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["voxray", "drain"], command
        # the head drains the app; a worker hands its node's LLM streams (with their KV) to the others
        assert ("--move-out-node" in command) == (group != "head"), (group, command)
        options = [arg for arg in command[2:] if arg != "--move-out-node"]
        flags = dict(zip(options[::2], options[1::2], strict=True))
        assert flags["--app"] == config.app_name and float(flags["--grace-s"]) == config.drain.grace_s
        assert grace_period_s >= float(flags["--grace-s"]) + 10  # the drain or move, its last chunks, Ray's stop

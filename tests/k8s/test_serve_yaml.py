"""cluster.serve_yaml: Serve configs generated from ServeConfig YAMLs, validated by Ray and by us."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from cluster.serve_yaml import GENERATED, drifted_files, main, serve_schema_dict
from core.config import CHECK_FILES, ServeConfig, load_serve_config
from tests.k8s.manifests import OVERLAY_CONFIGS, REPO_ROOT
from tests.k8s.serve_checks import serve_config_errors

CONFIGS = sorted(set(OVERLAY_CONFIGS.values()))
GPU_1 = "deployments/configs/gpu-1.yaml"  # one machine, no k8s overlay
ALL_CONFIGS = sorted({*CONFIGS, GPU_1})


def _config(path: str) -> ServeConfig:
    return load_serve_config(REPO_ROOT / path, check_files=False)  # TLS files are in the pods


@pytest.mark.parametrize("path", ALL_CONFIGS)
def test_serve_config_passes_ray_schema_and_ours(path: str) -> None:
    assert serve_config_errors(serve_schema_dict(_config(path))) == []


def test_default_serve_config_is_valid() -> None:
    assert serve_config_errors(serve_schema_dict(ServeConfig())) == []


@pytest.mark.parametrize("path", ALL_CONFIGS)
def test_args_round_trip_to_the_same_config(path: str) -> None:
    config = _config(path)
    (app,) = serve_schema_dict(config)["applications"]
    assert ServeConfig.model_validate(app["args"], context={CHECK_FILES: False}) == config
    assert app["import_path"] == "deployments.app:app_builder"


def test_deployments_follow_their_stage_config() -> None:
    config = _config("deployments/configs/gpu.yaml")
    serve = serve_schema_dict(config)
    by_name = {d["name"]: d for d in serve["applications"][0]["deployments"]}
    assert list(by_name) == ["Router", "LLMStage", "DetokStage"]
    for name, stage in (("Router", config.router), ("LLMStage", config.llm), ("DetokStage", config.detok)):
        entry = by_name[name]
        assert entry["max_ongoing_requests"] == stage.max_ongoing_requests
        assert entry["ray_actor_options"]["num_cpus"] == stage.num_cpus
        assert entry["ray_actor_options"]["num_gpus"] == stage.num_gpus
        assert entry["ray_actor_options"].get("resources", {}) == stage.resources
        if stage.autoscaling:
            assert "num_replicas" not in entry
            assert entry["autoscaling_config"]["max_replicas"] == stage.max_replicas
        else:
            assert entry["num_replicas"] == stage.num_replicas
    assert "grpc_options" not in serve  # the Router replicas serve gRPC: Serve's gRPC proxy stays off


def test_yaml_options_match_the_app_builder() -> None:
    """`serve deploy` / KubeRay and `voxray serve` must give each deployment the same options."""
    app = pytest.importorskip("deployments.app", reason="the Serve app (cluster issue) is not in this tree yet")
    config = _config("deployments/configs/gpu.yaml")
    entries = serve_schema_dict(config)["applications"][0]["deployments"]
    stages = ((config.router, None), (config.llm, "llm"), (config.detok, "detok"))
    for entry, (stage, kind) in zip(entries, stages, strict=True):
        options = app.deployment_options(stage, config.drain.serve_graceful_timeout_s, kind)
        autoscaling = options.get("autoscaling_config")
        if autoscaling is not None:
            options["autoscaling_config"] = {key: getattr(autoscaling, key) for key in entry["autoscaling_config"]}
            policy = options["autoscaling_config"].get("policy")
            if policy is not None:  # the SLO policy (deployments.autoscaling): Serve keeps its import path
                public = {"policy_function", "policy_kwargs"}
                options["autoscaling_config"]["policy"] = policy.model_dump(include=public)
        assert {"name": entry["name"], **options} == entry


def test_gpu_config_is_a_production_gpu_config() -> None:
    config = _config("deployments/configs/gpu.yaml")
    assert config.engine.model.name == "orpheus"
    assert config.engine.model.device == "cuda" and config.engine.detok.device == "cuda"
    for stage in (config.llm, config.detok):
        assert stage.num_gpus == 1 and stage.autoscaling and stage.resources
        assert stage.autoscaling_policy == "slo"  # scaled on TTFA / KV use and deadline slack (core.autoscaling)
    assert set(config.llm.resources).isdisjoint(config.detok.resources), "stages must steer to different groups"
    assert str(config.engine.model.checkpoint_dir).startswith("/models/")
    assert str(config.engine.model.codec_dir).startswith("/models/")


def test_gpu_1_config_shares_one_gpu_on_loopback() -> None:
    config = _config(GPU_1)
    assert config.engine.model.name == "orpheus" and config.engine.model.device == "cuda"
    assert config.engine.detok.device == "cuda"
    stages = (config.llm, config.detok)
    assert all(0 < stage.num_gpus < 1 and not stage.autoscaling and stage.num_replicas == 1 for stage in stages)
    assert sum(stage.num_gpus for stage in stages) <= 1, "both replicas must fit the one GPU"
    assert not any(stage.resources for stage in (config.router, *stages)), "one node: no worker groups to steer to"
    assert (config.http_host, config.grpc_host, config.ray_loopback_only) == ("127.0.0.1", "127.0.0.1", True)
    gpu = _config("deployments/configs/gpu.yaml")  # the same measurement sizes both
    assert (config.engine.cache, config.engine.scheduler) == (gpu.engine.cache, gpu.engine.scheduler)
    assert config.admission.max_streams_per_replica <= config.engine.cache.num_slots


@pytest.mark.parametrize("path", ["deployments/configs/gpu.yaml", GPU_1])
def test_gpu_configs_state_cuda_graphs_on_for_both_stages(path: str) -> None:
    engine = yaml.safe_load((REPO_ROOT / path).read_text())["engine"]
    assert engine["scheduler"]["cuda_graphs"] is True and engine["detok"]["cuda_graphs"] is True  # said, not implied


def test_cpu_config_needs_no_gpu_and_no_weights() -> None:
    config = _config("deployments/configs/cpu.yaml")
    assert config.engine.model.name == "orpheus-tiny" and config.engine.model.checkpoint_dir is None
    assert all(stage.num_gpus == 0 for stage in (config.router, config.llm, config.detok))
    assert any(stage.num_cpus % 1 for stage in (config.router, config.llm, config.detok)), "fractional CPUs"


@pytest.mark.parametrize("path", CONFIGS)
def test_cluster_configs_listen_on_all_interfaces(path: str) -> None:
    # 127.0.0.1 would make the proxy and the Routers unreachable through the Kubernetes Service.
    config = _config(path)
    assert (config.http_host, config.grpc_host) == ("0.0.0.0", "0.0.0.0")
    assert not config.http_docs and not config.grpc_reflection


def test_the_default_config_listens_on_loopback_only() -> None:
    config = ServeConfig()
    assert (config.http_host, config.grpc_host, config.ray_loopback_only) == ("127.0.0.1", "127.0.0.1", True)
    assert not config.http_docs and not config.grpc_reflection and not config.tls.enabled


def test_committed_generated_files_match_the_generator() -> None:
    assert drifted_files() == [], "run `python -m cluster.serve_yaml --write` and commit the result"


def test_drift_is_detected(tmp_path: Path) -> None:
    for item in GENERATED:
        for rel in (item.source, item.target):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO_ROOT / rel, tmp_path / rel)
    assert drifted_files(tmp_path) == []
    gpu = tmp_path / "deployments/configs/gpu.yaml"
    gpu.write_text(gpu.read_text().replace("max_replicas: 8", "max_replicas: 6"))
    assert set(drifted_files(tmp_path)) == {i.target for i in GENERATED if i.source.endswith("gpu.yaml")}


def test_cli_prints_the_serve_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    path = REPO_ROOT / "deployments/configs/cpu.yaml"
    assert main([str(path)]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == serve_schema_dict(load_serve_config(path, check_files=False))


def test_cli_check_passes_on_the_committed_tree(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_typo_in_a_deployment_field_fails() -> None:
    serve = serve_schema_dict(_config("deployments/configs/cpu.yaml"))
    serve["applications"][0]["deployments"][0]["num_replcas"] = 2
    assert serve_config_errors(serve) == ["unknown Serve config key: applications[0].deployments[0].num_replcas"]


def test_typo_in_actor_options_fails() -> None:
    serve = serve_schema_dict(_config("deployments/configs/gpu.yaml"))
    serve["applications"][0]["deployments"][1]["ray_actor_options"]["num_gpu"] = 1
    assert any("ray_actor_options.num_gpu" in error for error in serve_config_errors(serve))


def test_typo_in_app_args_fails_our_config() -> None:
    serve = serve_schema_dict(_config("deployments/configs/cpu.yaml"))
    serve["applications"][0]["args"]["engine"]["cache"]["num_slot"] = 8
    assert any("args are not a ServeConfig" in error for error in serve_config_errors(serve))


def test_ray_rejects_replicas_with_autoscaling() -> None:
    serve = serve_schema_dict(_config("deployments/configs/gpu.yaml"))
    serve["applications"][0]["deployments"][1]["num_replicas"] = 2
    assert any("ServeDeploySchema" in error for error in serve_config_errors(serve))

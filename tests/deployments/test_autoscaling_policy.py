"""The SLO policy as Ray Serve 2.60 runs it (`deployments.autoscaling`): built from the config's
`AutoscalingConfig` (the policy cloudpickled by Serve), wrapped by Serve's own delay / bounds logic,
called with Serve's `AutoscalingContext` holding the replicas' custom stats; the module loads in a
fresh interpreter without torch (the controller imports it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from core.autoscaling import LLM_PREDICTED_TTFA_S, LLM_STREAM_USE
from core.config import SLOScalingConfig, StageDeploymentConfig
from deployments.autoscaling import autoscaling_config

ROOT = Path(__file__).resolve().parents[2]
STAGE = StageDeploymentConfig(
    autoscaling=True, min_replicas=1, max_replicas=2, autoscaling_policy="slo",
    slo=SLOScalingConfig(sustain_s=1.0, up_cooldown_s=0.0, down_cooldown_s=0.0),
)  # fmt: skip
DEPLOYMENT = DeploymentID(name="LLMStage", app_name="voxray")


def _serve_policy(config: AutoscalingConfig):
    """What Serve's controller calls each tick (`DeploymentAutoscalingState.update_deployment`)."""
    return _apply_autoscaling_config(_resolve_policy_callable(config.policy))


def _context(config: AutoscalingConfig, stats: dict[str, list[float]], target: int, state: dict, now_s: float):
    replicas = [ReplicaID(f"r{i}", DEPLOYMENT) for i in range(target)]
    aggregated = {name: dict(zip(replicas, values, strict=True)) for name, values in stats.items()}
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name="LLMStage", app_name="voxray", current_num_replicas=target,
        target_num_replicas=target, running_replicas=replicas, total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=aggregated, raw_metrics={}, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state=state, last_scale_up_time=None,
        last_scale_down_time=None, current_time=now_s, config=config,
    )  # fmt: skip


def test_serve_builds_and_calls_the_slo_policy_up_then_down() -> None:
    config = AutoscalingConfig(**autoscaling_config(STAGE.model_dump(mode="json"), "llm"))
    assert config.upscale_delay_s == 0 and config.downscale_delay_s == 0  # the hysteresis is the policy's
    policy = _serve_policy(config)
    busy = {LLM_PREDICTED_TTFA_S: [0.4], LLM_STREAM_USE: [1.0]}  # at the stream cap: pressure 1.18
    num, state = policy(_context(config, busy, 1, {}, now_s=100.0))
    assert num == 1  # wished, not yet sustained
    num, state = policy(_context(config, busy, 1, state, now_s=101.5))
    assert num == 2
    idle = {LLM_PREDICTED_TTFA_S: [0.2, 0.2], LLM_STREAM_USE: [0.0, 0.0]}  # 0.4 on one replica: under 0.45
    num, state = policy(_context(config, idle, 2, state, now_s=102.0))
    num, state = policy(_context(config, idle, 2, state, now_s=103.5))
    assert num == 1


def test_router_cannot_use_the_slo_policy() -> None:
    try:
        autoscaling_config(STAGE.model_dump(mode="json"), None)
    except ValueError as err:
        assert "router.autoscaling_policy" in str(err)
    else:
        raise AssertionError("the Router accepted the slo policy")


def test_policy_module_loads_without_torch() -> None:
    code = "import sys, deployments.autoscaling; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

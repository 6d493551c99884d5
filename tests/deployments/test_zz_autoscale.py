"""SLO autoscaling on a real local Ray + Serve (CPU preset, orpheus-tiny): the short load ramp of
`loadtest.autoscale_ramp` (4 users, then 2) takes the LLM stage from 1 to 2 replicas and back to 1
through the SLO policy in Serve's controller; the leaving replica's streams move out, so no stream
fails; the policy's decisions are on the Prometheus endpoint."""

from __future__ import annotations

import dataclasses

import pytest
from ray import serve

from loadtest.autoscale_ramp import RAMP_ADMISSION, RAMP_SLO, RAMP_STAGE, SHORT, ramp_app_config, run_ramp
from tests.deployments.conftest import METRICS_PORT, small_config

pytestmark = pytest.mark.slow

RAMP = ramp_app_config(
    small_config(app_name="voxray-ramp", route_prefix="/ramp", llm=RAMP_STAGE, detok=RAMP_STAGE,
                 admission=RAMP_ADMISSION),
    autoscale=True, max_llm=2, slo=RAMP_SLO,
)  # fmt: skip


def test_llm_stage_scales_up_and_down_with_the_load_ramp(cluster):
    from cluster.server import deploy_app
    from loadtest.sweep import wait_ready

    ep = deploy_app(RAMP)
    try:
        wait_ready(ep.grpc_target, ep.app_name, timeout_s=60.0)
        result = run_ramp(ep.grpc_target, dataclasses.replace(SHORT, app_name=ep.app_name), "test", METRICS_PORT)
    finally:
        serve.delete(ep.app_name)
    summary = result.summary()
    print(summary)
    assert result.llm_trajectory()[:3] == [1, 2, 1], summary
    assert summary["failed"] == 0, [s.record.error for s in result.streams if not s.record.is_ok]
    assert summary["decisions"].get("LLMStage up pressure_high", 0) >= 1, summary
    assert summary["decisions"].get("LLMStage down pressure_low", 0) >= 1, summary

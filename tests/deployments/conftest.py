"""One real local Ray + Serve for the cluster tests, with two apps deployed once per session.

`voxray` (1 LLM replica, tight admission: 2 streams + 1 queued) for admission, cancellation and
bad input; `voxray-dp` (2 LLM replicas : 1 detok replica) for dispatch and concurrency.
"""

from __future__ import annotations

import os

import pytest

from core.config import AdmissionConfig, ServeConfig, StageDeploymentConfig
from tests.deployments.grpc_helpers import run_stream

# Replicas report their metrics every second here (Ray's default: 10 s), so the gauge tests see a
# stream's gauges move within its life. Read by Ray when the session cluster starts.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
# Replicas push their autoscaling stats every second here (Ray's default: 10 s), so the SLO
# autoscaling test (test_zz_autoscale) sees a load ramp within seconds. Only autoscaled apps push.
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")

# VOXRAY_TEST_PORT_OFFSET lets two checkouts run their cluster tests side by side on one machine.
_OFFSET = int(os.environ.get("VOXRAY_TEST_PORT_OFFSET", "0"))
GRPC_PORT = 19000 + _OFFSET  # each app's Router serves gRPC on a port of its own: GRPC_PORT + APP_GRPC_PORTS[app]
APP_GRPC_PORTS = {"voxray": 0, "voxray-dp": 1, "voxray-auth": 2, "voxray-fo": 3, "voxray-docs": 4, "voxray-llm-fo": 5,
                  "voxray-lone": 6, "voxray-move": 7, "voxray-s3gen": 8, "voxray-agents": 9,
                  "voxray-voices": 10, "voxray-voices-os": 11, "voxray-rebal": 12,
                  "voxray-bistream": 13, "voxray-oom": 14, "voxray-devlost": 15,
                  "voxray-ramp": 16, "voxray-multi": 17, "voxray-speech-in": 18, "voxray-glm": 19}  # fmt: skip
HTTP_PORT = 18000 + _OFFSET
METRICS_PORT = 18080 + _OFFSET


def replica_tags(app_name: str, deployment: str) -> list[str]:
    """`<deployment>#<id>` of every live replica of `deployment` in `app_name`."""
    import ray

    app_prefix = f"SERVE_REPLICA::{app_name}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return [name.removeprefix(app_prefix) for name in names if name.startswith(f"{app_prefix}{deployment}#")]


def call_replica(app_name: str, tag: str, method: str, *args):
    """`method(*args)` of replica `tag` (`<deployment>#<id>`) of `app_name`, asked of its actor. A handle
    would pick the replica itself, and the LLM stage's router (`router.dispatch.PredictedTTFARouter`) picks
    the one with the lowest predicted TTFA: never the one busy with the stream a test asks about."""
    import ray

    def call(actor):  # runs in the replica actor (Ray's `__ray_call__`)
        return getattr(actor._replica_impl._user_callable_wrapper.user_callable, method)(*args)

    [actor] = [ray.get_actor(a["name"], namespace=a["namespace"])
               for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"] == f"SERVE_REPLICA::{app_name}#{tag}"]  # fmt: skip
    return ray.get(actor.__ray_call__.remote(call), timeout=60)


def deployment_actor_names(app_name: str, deployment: str, name: str) -> list[str]:
    """Live named actors of Serve's deployment actor `name` of `deployment` in `app_name` (Serve names
    them by app, deployment, code version and name)."""
    import ray

    prefix, suffix = f"SERVE_DEPLOYMENT_ACTOR::{app_name}::{deployment}::", f"::{name}"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix) and a["name"].endswith(suffix)]  # fmt: skip


# The one session app whose replicas run the start-up warm-up (`engine.warm_up`, checked in test_cluster); the
# others skip it (~1-3 s a replica start here, replacements included) unless a test sets it: the warm-up's own
# tests are tests/llm_stage/test_warm_up.py and tests/detok_stage/test_warm_up.py, and the served benches'
# configs (chaos, soak, sweep, exposure) keep it on.
WARMED_APP = "voxray"


def small_config(**overrides) -> ServeConfig:
    app_name = overrides.get("app_name", "voxray")
    base = ServeConfig(app_name=app_name, grpc_port=GRPC_PORT + APP_GRPC_PORTS[app_name], http_port=HTTP_PORT)
    config = base.model_copy(update=overrides)
    if app_name == WARMED_APP:
        return config
    cold = {"warm_up": False}
    if "warm_up" not in config.engine.model_fields_set:
        config = config.model_copy(update={"engine": config.engine.model_copy(update=cold)})
    models = tuple(m if "warm_up" in m.engine.model_fields_set else m.model_copy(update={"engine": m.engine.model_copy(
        update=cold)}) for m in config.models)  # fmt: skip
    return config.model_copy(update={"models": models}) if models else config


TIGHT = small_config(admission=AdmissionConfig(max_streams_per_replica=2, max_queued_per_replica=1))
DATA_PARALLEL = small_config(
    app_name="voxray-dp", route_prefix="/dp", llm=StageDeploymentConfig(num_replicas=2),
    # 8 at once may all queue on one replica (a slow figure measured while other tests loaded the box can
    # hold its pace limit at 1): queued, they start in turn; the functional tests here are not about capacity
    admission=AdmissionConfig(max_streams_per_replica=4, max_queued_per_replica=8, default_ttfa_deadline_s=60.0),
)  # fmt: skip


@pytest.fixture(scope="session")
def cluster():
    from cluster.server import deploy, deploy_app, shutdown

    endpoints = {
        "tight": deploy(TIGHT, num_cpus=4, metrics_export_port=METRICS_PORT, quiet=True),
        "dp": deploy_app(DATA_PARALLEL),
    }
    for ep in endpoints.values():  # warm the handles and Serve's gRPC error path (~2 s cold, once)
        run_stream(ep.grpc_target, ep.app_name, "warm up", sampling={"max_tokens": 7})
        run_stream(ep.grpc_target, ep.app_name, "")
    yield endpoints
    shutdown()

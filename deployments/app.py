"""App builder: one validated ServeConfig -> the Router, LLMStage and DetokStage deployments.

`build_app(config)` is used by `voxray serve`; `app_builder(args)` is the Serve import path
(`deployments.app:app_builder`) that Serve YAML / KubeRay `serveConfigV2` point at. gRPC is served
by the Router replicas themselves (`router.grpc_server`), so Serve's gRPC proxy stays off.
"""

from __future__ import annotations

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from core.config import CHECK_FILES, GRACEFUL_WAIT_LOOP_S, ServeConfig, StageDeploymentConfig
from deployments.autoscaling import autoscaling_config
from deployments.detok_stage import DetokStage
from deployments.kv_courier import courier_actors
from deployments.llm_stage import LLMStage
from deployments.voices import bank_actors
from router.ingress import Router


def deployment_options(stage: StageDeploymentConfig, graceful_timeout_s: float, kind: str | None = None) -> dict:
    """Serve deployment options for one stage (the same mapping the Serve YAML generator uses);
    `kind` ("llm" / "detok", None for the Router) picks the SLO autoscaling signals."""
    actor_options: dict = {"num_cpus": stage.num_cpus, "num_gpus": stage.num_gpus}
    if stage.resources:
        actor_options["resources"] = dict(stage.resources)
    options: dict = {
        "max_ongoing_requests": stage.max_ongoing_requests,
        "ray_actor_options": actor_options,
        "graceful_shutdown_timeout_s": graceful_timeout_s,
        "graceful_shutdown_wait_loop_s": GRACEFUL_WAIT_LOOP_S,
        "health_check_period_s": stage.health_check_period_s,
    }
    if stage.autoscaling:
        options["autoscaling_config"] = AutoscalingConfig(**autoscaling_config(stage.model_dump(mode="json"), kind))
    else:
        options["num_replicas"] = stage.num_replicas
    return options


def build_app(config: ServeConfig) -> serve.Application:
    args = config.model_dump(mode="json")
    graceful_s = config.drain.serve_graceful_timeout_s
    detok_router = RequestRouterConfig(
        request_router_class="router.dispatch:DetokBoard", request_routing_stats_period_s=0.5
    )  # Serve's default routing, keeping the detok replicas' reports for the LLM replicas' admission
    detok_options = deployment_options(config.detok, graceful_s, "detok") | {"deployment_actors": bank_actors(config)}
    detok = serve.deployment(DetokStage, name="DetokStage", request_router_config=detok_router, **detok_options)
    detok = detok.bind(args)
    llm_router = RequestRouterConfig(
        request_router_class="router.dispatch:PredictedTTFARouter", request_routing_stats_period_s=0.5
    )
    llm_options = deployment_options(config.llm, graceful_s, "llm") | {"deployment_actors": courier_actors(config)}
    llm = serve.deployment(LLMStage, name="LLMStage", request_router_config=llm_router, **llm_options)
    llm = llm.bind(args, detok)
    router = serve.deployment(Router, name="Router", **deployment_options(config.router, graceful_s))
    return router.bind(args, llm, detok)


def app_builder(args: dict) -> serve.Application:
    """Serve's application-builder entry point: `args` is a ServeConfig dump (its TLS files are
    checked by the Router replicas that read them, not on the node that builds the app)."""
    return build_app(ServeConfig.model_validate(args or {}, context={CHECK_FILES: False}))

"""App builder: one validated ServeConfig -> the Router, LLMStage and DetokStage deployments (one
LLMStage per served model and one DetokStage per distinct detokenizer in a multi-model config).

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
from deployments.model_plan import ServedModel, plan_models
from deployments.voices import bank_actors, check_default_clip
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
    """The Router over one LLMStage deployment per served model and one DetokStage deployment per
    distinct detokenizer (`deployments.model_plan`; a single-model config: `LLMStage`, `DetokStage`)."""
    check_default_clip(config)
    graceful_s = config.drain.serve_graceful_timeout_s
    detoks: dict[str, serve.Application] = {}
    llm_handles: dict[str, serve.Application] = {}
    detok_handles: dict[str, serve.Application] = {}
    for served in plan_models(config):
        if served.detok_deployment not in detoks:  # the first model of a shared detokenizer builds it
            detoks[served.detok_deployment] = _detok_stage(served, graceful_s)
        detok = detoks[served.detok_deployment]
        llm_handles[served.name] = _llm_stage(served, detok, graceful_s)
        detok_handles[served.name] = detok
    router = serve.deployment(Router, name="Router", **deployment_options(config.router, graceful_s))
    return router.bind(config.model_dump(mode="json"), llm_handles, detok_handles)


def _detok_stage(served: ServedModel, graceful_s: float) -> serve.Application:
    detok_router = RequestRouterConfig(
        request_router_class="router.dispatch:DetokBoard", request_routing_stats_period_s=0.5
    )  # Serve's default routing, keeping the detok replicas' reports for the LLM replicas' admission
    options = deployment_options(served.view.detok, graceful_s, "detok")
    options |= {"deployment_actors": bank_actors(served.view)}
    detok = serve.deployment(DetokStage, name=served.detok_deployment, request_router_config=detok_router, **options)
    return detok.bind(served.view.model_dump(mode="json"))


def _llm_stage(served: ServedModel, detok: serve.Application, graceful_s: float) -> serve.Application:
    llm_router = RequestRouterConfig(
        request_router_class="router.dispatch:PredictedTTFARouter", request_routing_stats_period_s=0.5
    )
    options = deployment_options(served.view.llm, graceful_s, "llm")
    options |= {"deployment_actors": courier_actors(served.view)}
    llm = serve.deployment(LLMStage, name=served.llm_deployment, request_router_config=llm_router, **options)
    return llm.bind(served.view.model_dump(mode="json"), detok)


def app_builder(args: dict) -> serve.Application:
    """Serve's application-builder entry point: `args` is a ServeConfig dump (its TLS files are
    checked by the Router replicas that read them, not on the node that builds the app)."""
    return build_app(ServeConfig.model_validate(args or {}, context={CHECK_FILES: False}))

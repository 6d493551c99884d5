"""Ray Serve's custom autoscaling hook for a stage, around `core.autoscaling.decide`.

Serve (2.60) runs the policy in its controller: `AutoscalingConfig.policy.policy_function` names
`SLOAutoscalingPolicy`, a class, so the controller builds it once with `policy_kwargs` and calls it
every control-loop tick with an `AutoscalingContext`. Its `aggregated_metrics` hold each running
replica's `record_autoscaling_stats()` dict (LLMStage / DetokStage), averaged by Serve over
`look_back_period_s`. Serve then applies its own delays and bounds to the returned count (we set
its delays to 0: the hysteresis and cool-downs are ours). Each decision is exported from the
controller as Prometheus series (`voxray_autoscale_*`). Imports: Ray and `core.autoscaling` only,
so the controller loads it without torch.
"""

from __future__ import annotations

import logging

from ray.util.metrics import Counter, Gauge

from core.autoscaling import Decision, ScalingState, StageTargets, Thresholds, decide, pressure

POLICY_PATH = "deployments.autoscaling:SLOAutoscalingPolicy"
logger = logging.getLogger("ray.serve")


class DecisionMetrics:
    """The decisions of every SLO-scaled deployment, from the Serve controller's process."""

    def __init__(self) -> None:
        tags = ("deployment", "application")
        self.target = Gauge("voxray_autoscale_target_replicas", "Replicas the SLO policy asks for.", tags)
        self.pressure = Gauge("voxray_autoscale_pressure", "Mean replica pressure (1 = at the SLO limit).", tags)
        self.replicas = Gauge("voxray_autoscale_reporting_replicas", "Replicas whose stats the policy read.", tags)
        self.decisions = Counter(
            "voxray_autoscale_decisions", "Scale-ups and scale-downs the SLO policy decided.",
            (*tags, "action", "reason"),
        )  # fmt: skip

    def record(self, deployment: str, application: str, decision: Decision, num_reporting: int) -> None:
        tags = {"deployment": deployment, "application": application}
        self.target.set(decision.num_replicas, tags=tags)
        self.pressure.set(decision.mean_pressure, tags=tags)
        self.replicas.set(num_reporting, tags=tags)
        if decision.action != "hold":
            self.decisions.inc(1, tags={**tags, "action": decision.action, "reason": decision.reason})


def autoscaling_config(stage: dict, kind: str | None) -> dict:
    """Serve's `autoscaling_config` for a `StageDeploymentConfig` dump with autoscaling on (the
    same dict for `serve.deployment` and the Serve YAML); `kind` is "llm" / "detok" (None: Router)."""
    config = {k: stage[k] for k in ("min_replicas", "max_replicas", "target_ongoing_requests")}
    if stage["autoscaling_policy"] != "slo":
        return config
    if kind is None:
        raise ValueError("router.autoscaling_policy: slo scales the llm and detok stages only")
    slo = stage["slo"]
    kwargs = {"stage": kind, **{k: v for k, v in slo.items() if k != "look_back_s"}}
    # Serve's own delays off: the hysteresis and cool-downs are the policy's
    return config | {"upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "look_back_period_s": slo["look_back_s"],
                     "policy": {"policy_function": POLICY_PATH, "policy_kwargs": kwargs}}  # fmt: skip


def per_replica_stats(aggregated: dict[str, dict] | None) -> list[dict[str, float]]:
    """{metric: {replica: value}} (Serve's layout) -> one stats dict per replica that reported."""
    by_replica: dict = {}
    for name, values in (aggregated or {}).items():
        for replica_id, value in values.items():
            by_replica.setdefault(replica_id, {})[name] = float(value)
    return list(by_replica.values())


class SLOAutoscalingPolicy:
    """One deployment's policy instance in the Serve controller (Serve keeps it between ticks)."""

    def __init__(self, stage: str, **slo: float) -> None:
        target_keys, band_keys = StageTargets.__dataclass_fields__, Thresholds.__dataclass_fields__
        self.targets = StageTargets(stage, **{k: v for k, v in slo.items() if k in target_keys})
        self.thresholds = Thresholds(**{k: v for k, v in slo.items() if k in band_keys})
        self.metrics: DecisionMetrics | None = None  # made on the first tick, in the controller

    def __call__(self, ctx) -> tuple[int, dict]:
        stats = per_replica_stats(ctx.aggregated_metrics)
        pressures = [pressure(replica, self.targets) for replica in stats]
        state = ScalingState.from_dict(ctx.policy_state)
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        decision = decide(pressures, ctx.target_num_replicas, lo, hi, state, ctx.current_time, self.thresholds)
        if self.metrics is None:
            self.metrics = DecisionMetrics()
        self.metrics.record(ctx.deployment_name, ctx.app_name or "", decision, len(stats))
        if decision.action != "hold":
            logger.info(
                f"voxray autoscale {ctx.deployment_name}: {decision.action} to {decision.num_replicas} "
                f"({decision.reason}, mean pressure {decision.mean_pressure:.2f} over {len(stats)} replicas)"
            )
        return decision.num_replicas, {**ctx.policy_state, **decision.state.to_dict()}

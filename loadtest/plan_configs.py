"""The configurations `loadtest.plan_check` serves and simulates: replicas per stage and the admission cap, the
served config of each (`serve_config`), the planner's shape of it (`shape_of`) and the sweep's prompt mix as the
planner's workload (`sweep_workload`). Shared by the check's served side (`plan_served`), its draws
(`plan_draws`, `plan_replay`), the calibration (`plan_calibrate`, `host_cost`) and the traces (`plan_trace`,
`loop_stalls`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.planner.search import DEFAULT_MAX_STARTING
from cluster.planner.simulate import ClusterShape
from cluster.planner.workload import ModelRates, Workload
from loadtest.workload import MAX_FRAMES, MIN_FRAMES, load_prompts

ORPHEUS_TINY = ModelRates(24000 / 2048, 7)


# the box's speed around the draws may differ from the calibration's by this share before a capacity
# measured at it says nothing of the planner (the CPU preset is CPU-bound: its capacity moves with the cores)
SPEED_TOLERANCE = 0.10


@dataclass(frozen=True)
class CheckConfig:
    """One configuration: replicas per stage and the admission cap (the 2 cores every process shares are
    the calibration's `host` section)."""

    name: str
    llm_replicas: int
    detok_replicas: int
    max_streams_per_replica: int


CONFIGS = (
    CheckConfig("cpu-1x1", 1, 1, 12),  # deployments/configs/cpu.yaml as loadtest.serve_voxray serves it
    CheckConfig("cpu-2x2", 2, 2, 12),  # loadtest.cluster_process.two_replica_config
    CheckConfig("cpu-1x1-cap4", 1, 1, 4),  # admission as the bottleneck
)


def sweep_workload() -> Workload:
    """The sweep's prompts, their frames clamped as the sweep clamps each request's max_tokens."""
    chars = tuple(len(text) for text in load_prompts())
    return Workload(text_chars=chars, min_frames=MIN_FRAMES, max_frames=MAX_FRAMES)


def shape_of(config: CheckConfig) -> ClusterShape:
    """The planner's shape of a configuration (the replica's start limit as served)."""
    return ClusterShape(config.llm_replicas, config.detok_replicas, config.max_streams_per_replica,
                        DEFAULT_MAX_STARTING)  # fmt: skip


def serve_config(config: CheckConfig, grpc_port: int, http_port: int):  # -> ServeConfig
    from loadtest.cluster_process import two_replica_config
    from loadtest.serve_voxray import loadtest_config

    two = config.llm_replicas == 2
    base = two_replica_config(grpc_port, http_port) if two else loadtest_config(grpc_port, http_port)
    admission = base.admission.model_copy(update={"max_streams_per_replica": config.max_streams_per_replica})
    return base.model_copy(update={"admission": admission})


def max_requests_for(rates: tuple[float, ...], duration_s: float) -> int:
    """The sweep's cap on a draw's requests (the planner's draws take the same)."""
    return int(duration_s * max(rates)) + 8

"""`voxray serve`: start (or join) Ray, start Serve with HTTP + gRPC proxies, deploy the app.

With no address it starts an embedded local Ray; `--address` deploys onto an existing cluster.
Used by the CLI and by the cluster tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import gRPCOptions

from core.config import ServeConfig
from deployments.app import GRPC_SERVICER, build_app


@dataclass(frozen=True)
class Endpoints:
    grpc_target: str
    http_url: str
    app_name: str


def start_ray(
    address: str | None, num_cpus: int | None = None, metrics_export_port: int | None = None, quiet: bool = False
) -> None:
    """Join `address`, or start an embedded local Ray (Prometheus metrics on `metrics_export_port`).

    `quiet` keeps replica logs out of this process's output (tests)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
        return
    extra = {"_metrics_export_port": metrics_export_port} if metrics_export_port else {}
    ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=not quiet, **extra)


def deploy(
    config: ServeConfig,
    address: str | None = None,
    num_cpus: int | None = None,
    metrics_export_port: int | None = None,
    quiet: bool = False,
) -> Endpoints:
    """Start Ray and Serve (proxies on the config's ports) and deploy the app."""
    start_ray(address, num_cpus, metrics_export_port, quiet)
    serve.start(
        http_options={"host": config.http_host, "port": config.http_port},
        grpc_options=gRPCOptions(port=config.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]),
    )
    return deploy_app(config)


def deploy_app(config: ServeConfig) -> Endpoints:
    """Deploy one more app onto a running Serve (its ports are the running proxies')."""
    serve.run(build_app(config), name=config.app_name, route_prefix=config.route_prefix)
    host = "127.0.0.1" if config.http_host in ("0.0.0.0", "127.0.0.1") else config.http_host
    return Endpoints(f"{host}:{config.grpc_port}", f"http://{host}:{config.http_port}", config.app_name)


def shutdown() -> None:
    serve.shutdown()
    ray.shutdown()

"""`voxray serve`: start (or join) Ray, start Serve with HTTP + gRPC proxies, deploy the app.

With no address it starts an embedded local Ray; `--address` deploys onto an existing cluster.
Used by the CLI and by the cluster tests.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import gRPCOptions

from core.config import ServeConfig
from deployments.app import GRPC_SERVICER, build_app
from router.drain import clear_drain


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
    clear_drain(config.app_name)  # a drain of an earlier deployment of this app is over
    serve.run(build_app(config), name=config.app_name, route_prefix=config.route_prefix)
    host = "127.0.0.1" if config.http_host in ("0.0.0.0", "127.0.0.1") else config.http_host
    return Endpoints(f"{host}:{config.grpc_port}", f"http://{host}:{config.http_port}", config.app_name)


def shutdown(reap: bool = False) -> None:
    """Stop Serve and Ray; `reap` (a Ray this process started) also stops the session's agents,
    which can outlive `ray.shutdown`."""
    session_dir = ray_session_dir() if reap and ray.is_initialized() else None
    serve.shutdown()
    ray.shutdown()
    if session_dir is not None:
        reap_session(session_dir)


def ray_session_dir() -> str:
    return ray._private.worker._global_node.get_session_dir_path()


def session_pids(session_dir: str) -> list[int]:
    """Processes whose command line names this Ray session (its agents can outlive ray.shutdown)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if session_dir.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def reap_session(session_dir: str, grace_s: float = 5.0) -> None:
    """Stop leftovers of the Ray session this process started, by pid (never by name):
    SIGTERM, up to `grace_s` to exit, then SIGKILL."""
    give_up_s = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(session_dir):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        while session_pids(session_dir) and time.monotonic() < give_up_s:
            time.sleep(0.1)

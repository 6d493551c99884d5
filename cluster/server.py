"""`voxray serve`: start (or join) Ray, start Serve's HTTP proxy, deploy the app.

With no address it starts an embedded local Ray (on 127.0.0.1 only unless the config's
`ray_loopback_only` is off); `--address` deploys onto an existing cluster. gRPC is served by the
Router replicas (`router.grpc_server`), so Serve's gRPC proxy is not started. Used by the CLI and
by the cluster tests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import gRPCOptions

from cluster.ray_loopback import loopback_init_kwargs
from core.config import ServeConfig, http_proxy_options
from deployments.app import build_app
from router.drain import clear_drain


@dataclass(frozen=True)
class Endpoints:
    grpc_target: str
    http_url: str
    app_name: str


# Ray starts its workers (every replica: the engines, the Router) at niceness 15, under the raylet
# and GCS. On a small machine running the embedded Ray that puts the engines behind every other
# process, the load generator and the gRPC clients included: measured 1.55x the cluster's audio
# throughput at niceness 0 (docs/experiments/2026-12-02-cluster-data-path.md, section 11).
# A Ray that VoxRay joins (KubeRay pods) keeps its own setting, and so does an embedded one when
# RAY_worker_niceness is set (Ray reads it itself: how the A/B ran).
EMBEDDED_WORKER_NICENESS = 0
WORKER_NICENESS_ENV = "RAY_worker_niceness"


def start_ray(
    address: str | None,
    num_cpus: int | None = None,
    metrics_export_port: int | None = None,
    quiet: bool = False,
    loopback_only: bool = True,
) -> None:
    """Join `address`, or start an embedded local Ray (Prometheus metrics on `metrics_export_port`;
    every Ray listener on 127.0.0.1 when `loopback_only`).

    `quiet` keeps replica logs out of this process's output (tests)."""
    if ray.is_initialized():
        return
    with _callers_stop_signals_kept():
        _init_ray(address, metrics_export_port, loopback_only, quiet, num_cpus)


def _init_ray(address: str | None, metrics_export_port: int | None, loopback_only: bool, quiet: bool, num_cpus) -> None:
    if address:
        ray.init(address=address)
        return
    extra: dict = {}
    if WORKER_NICENESS_ENV not in os.environ:
        extra["_system_config"] = {"worker_niceness": EMBEDDED_WORKER_NICENESS}
    if metrics_export_port:
        extra["_metrics_export_port"] = metrics_export_port
    if loopback_only:
        extra |= loopback_init_kwargs()
    ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=not quiet, **extra)


@contextlib.contextmanager
def _callers_stop_signals_kept():
    """`ray.init` installs its own SIGTERM handler in the driver (it exits with code 15); put back
    the caller's, so a SIGTERM that comes while the app is still being deployed (`voxray serve`
    already serves gRPC then) reaches `voxray serve`'s drain instead of killing it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in kept.items():
            if handler is not None:
                signal.signal(signum, handler)


def deploy(
    config: ServeConfig,
    address: str | None = None,
    num_cpus: int | None = None,
    metrics_export_port: int | None = None,
    quiet: bool = False,
) -> Endpoints:
    """Start Ray and Serve (HTTP proxy on the config's host and port, TLS if configured; no gRPC
    proxy) and deploy the app."""
    start_ray(address, num_cpus, metrics_export_port, quiet, config.ray_loopback_only)
    serve.start(http_options=http_proxy_options(config), grpc_options=gRPCOptions(grpc_servicer_functions=[]))
    return deploy_app(config)


def deploy_app(config: ServeConfig) -> Endpoints:
    """Deploy one more app onto a running Serve (its ports are the running proxies')."""
    clear_drain(config.app_name)  # a drain of an earlier deployment of this app is over
    serve.run(build_app(config), name=config.app_name, route_prefix=config.route_prefix)
    scheme = "https" if config.tls.on_http else "http"
    http_url = f"{scheme}://{_client_host(config.http_host)}:{config.http_port}"
    return Endpoints(f"{_client_host(config.grpc_host)}:{config.grpc_port}", http_url, config.app_name)


def _client_host(listen_host: str) -> str:
    """Where a client on this machine reaches a listener on `listen_host`."""
    if listen_host in ("0.0.0.0", "localhost"):
        return "127.0.0.1"
    if listen_host == "::":
        return "[::1]"
    return f"[{listen_host}]" if ":" in listen_host else listen_host


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

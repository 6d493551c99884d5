"""A real `voxray serve` process for the endurance benches (`loadtest.chaos_bench`, `loadtest.soak`):
start it from a ServeConfig in its own session, wait until it streams audio, join its embedded Ray
as a driver (the GCS address and auth mode read from its process tree, so another Ray on the box is
never picked by `auto`), name every process of its tree, scrape its Prometheus endpoint, stop it.
Usage: with running_server(config, scratch_dir) as server: ...  (see chaos_bench / soak)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

from core.config import ServeConfig
from loadtest import server_start
from loadtest.server_start import start_until_serving

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 240.0
STOP_GRACE_S = 60.0  # SIGTERM drains (idle: ~1 s) and stops Ray; then the tree is SIGKILLed
PROMETHEUS_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")


def two_replica_config(grpc_port: int, http_port: int) -> ServeConfig:
    """The 2-replica CPU config: deployments/configs/cpu.yaml on loopback ports (`loadtest.serve_voxray`)
    with 2 LLM and 2 detok replicas, their logical CPUs cut so that they, the Router and a replacement
    replica fit the local Ray `voxray serve` starts on a 2-core box (Ray counts, the OS shares)."""
    from loadtest.serve_voxray import loadtest_config

    base = loadtest_config(grpc_port, http_port)
    stages = {
        "llm": base.llm.model_copy(update={"num_replicas": 2, "num_cpus": 0.5, "autoscaling": False}),
        "detok": base.detok.model_copy(update={"num_replicas": 2, "num_cpus": 0.25, "autoscaling": False}),
    }
    return base.model_copy(update=stages)


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    config: ServeConfig
    log_path: Path

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.config.grpc_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.config.http_port}/v1/audio/speech/stream"


def start_server(config: ServeConfig, scratch: Path, ready_timeout_s: float = READY_TIMEOUT_S) -> ServerProcess:
    """`voxray serve --config` in a new session (its log under `scratch`); returns once it streams audio.
    A server whose Ray timed out in its own start is started once more; any other early exit fails at
    once (`loadtest.server_start`)."""
    return start_until_serving(lambda: launch_server(config, scratch),
                               lambda server: wait_serving(server, ready_timeout_s), stop_server,
                               label="voxray serve")  # fmt: skip


def launch_server(config: ServeConfig, scratch: Path) -> ServerProcess:
    """The `voxray serve` process, its config and log under `scratch` (a later launch rewrites both)."""
    scratch.mkdir(parents=True, exist_ok=True)
    config_path = scratch / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    log_path = scratch / "serve.log"
    command = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    return ServerProcess(proc, config, log_path)


def wait_serving(server: ServerProcess, timeout_s: float) -> None:
    """Until the server streams audio; `ServerExited` as soon as its process ends (`server_start.wait_serving`)."""
    server_start.wait_serving(server.proc, server.log_path, server.grpc_target, server.config.app_name, timeout_s)


def stop_server(server: ServerProcess, grace_s: float = STOP_GRACE_S) -> int | None:
    """SIGTERM (drain, then Serve and Ray stop), up to `grace_s`; then SIGKILL what is left of its
    tree, by pid (psutil checks each pid is still the same process). Returns the exit code."""
    tree = tree_processes(server.proc.pid)
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=grace_s)
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=10)
    return server.proc.returncode


@contextlib.contextmanager
def running_server(config: ServeConfig, scratch: Path) -> Iterator[ServerProcess]:
    server = start_server(config, scratch)
    try:
        yield server
    finally:
        leave_cluster()
        stop_server(server)


def tree_processes(root_pid: int) -> list[psutil.Process]:
    """The process and all its descendants (Ray's daemons are its children, workers the raylet's)."""
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def process_role(proc: psutil.Process, root_pid: int) -> str:
    """A readable name: `voxray serve`, gcs_server, raylet, a Ray script (dashboard.py, log_monitor.py,
    monitor.py), or the title Ray gives a worker without its current method (`ray::ServeController`,
    `ray::ServeReplica:voxray:LLMStage`, `ray::ProxyActor`, `ray::IDLE`)."""
    if proc.pid == root_pid:
        return "voxray serve"
    cmdline = proc.cmdline()
    first = cmdline[0] if cmdline else proc.name()
    if first.startswith("ray::"):
        return re.match(r"ray::[^.\s]+", first).group(0)
    scripts = [Path(arg).name for arg in cmdline[1:4] if arg.endswith(".py")]
    return scripts[0] if scripts else Path(first).name


def gcs_address(root_pid: int) -> str:
    """`host:port` of the server's GCS, from its raylet's command line."""
    for proc in tree_processes(root_pid):
        with contextlib.suppress(psutil.Error):
            for arg in proc.cmdline():
                if arg.startswith("--gcs-address="):
                    return arg.split("=", 1)[1]
    raise RuntimeError(f"no raylet with --gcs-address under pid {root_pid}")


def ray_auth_mode(root_pid: int) -> str | None:
    """RAY_AUTH_MODE of the server's Ray (Ray sets `token` for its local cluster; a driver must match)."""
    for proc in tree_processes(root_pid):
        with contextlib.suppress(psutil.Error):
            if "RAY_AUTH_MODE" in (env := proc.environ()):
                return env["RAY_AUTH_MODE"]
    return None


def join_cluster(server: ServerProcess) -> None:
    """Connect this process to the server's Ray as a driver, on loopback as the server's Ray listens."""
    import ray

    from cluster.ray_loopback import loopback_init_kwargs

    address = gcs_address(server.proc.pid)
    if ray.is_initialized():
        joined = ray.get_runtime_context().gcs_address
        if joined != address:  # kills and queries would hit that other cluster's replicas
            raise RuntimeError(f"this process is already a driver of the Ray at {joined}, not the server's "
                               f"({address}): run the bench in a process of its own")  # fmt: skip
        return
    mode = ray_auth_mode(server.proc.pid)
    if mode is not None and os.environ.get("RAY_AUTH_MODE") != mode:
        from ray._raylet import Config

        os.environ["RAY_AUTH_MODE"] = mode  # read into Ray's config at import: refresh it, as Ray does itself
        Config.initialize("")  # (ray._private.authentication.authentication_token_setup._enable_token_auth)
    extra = loopback_init_kwargs() if server.config.ray_loopback_only else {}
    extra.pop("dashboard_host", None)  # a driver starts no dashboard
    ray.init(address=address, logging_level="ERROR", log_to_driver=False, **extra)


def leave_cluster() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def metrics_export_port() -> int:
    """The Prometheus port of the (single) node of the Ray this driver joined."""
    import ray

    [node] = [node for node in ray.nodes() if node["Alive"]]
    return int(node["MetricsExportPort"])


def scrape_metrics(port: int, prefixes: tuple[str, ...], timeout_s: float = 10.0) -> dict[str, float]:
    """Sum of every sample per series name (over tags) of the series named with one of `prefixes`."""
    import requests

    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = PROMETHEUS_LINE.match(line)
        if match and match.group(1).startswith(prefixes):
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
    return totals


def wait_for_metrics(port: int, prefix: str, timeout_s: float) -> float | None:
    """Seconds until the Prometheus endpoint on `port` has a series named with `prefix` (Ray's
    metrics agent starts after the cluster and exports every few seconds: slow on a small box), or
    None when it has none by `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if scrape_metrics(port, (prefix,), timeout_s=5.0):
                return time.monotonic() - t0
        except Exception:  # the agent is not listening yet
            pass
        time.sleep(1.0)
    return None


def live_replicas(app_name: str, deployment: str) -> dict[str, object]:
    """Replica id -> actor handle of `deployment`'s live replicas (Serve names them
    `SERVE_REPLICA::<app>#<deployment>#<id>`)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    return {
        actor["name"][len(prefix) :]: ray.get_actor(actor["name"], namespace=actor["namespace"])
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(prefix)
    }


def running_replicas(app_name: str, deployment: str) -> int:
    """Replicas Serve's controller reports RUNNING (0 while the deployment is not HEALTHY)."""
    from ray import serve

    state = serve.status().applications[app_name].deployments[deployment]
    return state.replica_states.get("RUNNING", 0) if state.status == "HEALTHY" else 0


def wait_replaced(app_name: str, deployment: str, before: set[str], target: int, timeout_s: float) -> float | None:
    """Seconds until a replica not in `before` exists and Serve runs `target` healthy replicas again
    (None: not within `timeout_s`). The new id proves the controller noticed the loss."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(Exception):  # the controller may be busy; ask again
            is_new = bool(set(live_replicas(app_name, deployment)) - before)
            if is_new and running_replicas(app_name, deployment) >= target:
                return time.monotonic() - start
        time.sleep(0.25)
    return None

"""Run VoxRay for a load test: the CPU config (deployments/configs/cpu.yaml) on loopback ports.

Starts its own local Ray via `cluster.server.deploy`, serves until SIGTERM/SIGINT, then shuts
Serve and that Ray down. Used by `loadtest.run_all` and the sweep smoke test.
Usage: python -m loadtest.serve_voxray --grpc-port 19110 --http-port 19111
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from core.config import ServeConfig, load_serve_config

CPU_CONFIG = Path(__file__).resolve().parents[1] / "deployments" / "configs" / "cpu.yaml"


def loadtest_config(grpc_port: int, http_port: int, config_path: Path = CPU_CONFIG) -> ServeConfig:
    """The given Serve config with loopback-only proxies on the load test's own ports."""
    base = load_serve_config(config_path)
    loopback = {"http_host": "127.0.0.1", "grpc_host": "127.0.0.1", "ray_loopback_only": True}
    return base.model_copy(update={"grpc_port": grpc_port, "http_port": http_port, **loopback})


def serve_until_signalled(config: ServeConfig, num_cpus: int) -> None:
    from cluster.server import deploy, shutdown

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    endpoints = deploy(config, num_cpus=num_cpus)
    print(f"READY {endpoints.grpc_target} app={endpoints.app_name}", flush=True)
    try:
        stop.wait()
    finally:
        shutdown(reap=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grpc-port", type=int, default=19110)
    p.add_argument("--http-port", type=int, default=19111)
    p.add_argument("--config", type=Path, default=CPU_CONFIG)
    p.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray (fractions per stage)")
    args = p.parse_args(argv)
    serve_until_signalled(loadtest_config(args.grpc_port, args.http_port, args.config), args.num_cpus)


if __name__ == "__main__":
    main()

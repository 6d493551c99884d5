"""Puts the embedded local Ray on 127.0.0.1: every listener it opens then binds loopback only.

Ray has no bind-host setting for its own servers: the GCS, raylet, core workers, dashboard and
runtime-env agents and the metrics exporter all listen on the node's address, or on every
interface for some, unless that address is loopback. On Linux Ray replaces a loopback
`_node_ip_address` with the machine's network address unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
(named for the OSes where it is the default). `voxray serve` sets it here, in its own process (read
by Ray at import, so the already-imported constant is set too) and its environment, which the
raylet, agents and workers inherit. Serve replicas' internal gRPC listener: `router.replica_listener`.
"""

from __future__ import annotations

import os

LOOPBACK = "127.0.0.1"
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps a loopback node address


def loopback_init_kwargs() -> dict:
    """`ray.init` arguments for an embedded Ray listening on loopback only (sets Ray's env as above)."""
    from ray._private import ray_constants

    os.environ[SINGLE_NODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    return {"_node_ip_address": LOOPBACK, "dashboard_host": LOOPBACK}

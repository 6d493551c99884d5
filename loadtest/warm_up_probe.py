"""Each stage replica's RSS after bursts of concurrent streams, with and without the start-up warm-up.

Starts `voxray serve` of the loadtest CPU config (one replica per stage) as a process, once per
`engine.warm_up` setting, sends bursts of `--bursts` concurrent gRPC streams (the sweep's prompts,
seeded), and samples every replica's RSS 2 s after each burst: a replica whose memory steps up at
the first burst bigger than any before shows it here within minutes (the soak takes an hour).
Starts Ray: never run it beside another benchmark.
Usage: python -m loadtest.warm_up_probe --out bench_out/warm_up_probe.json
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

import grpc
import psutil

from cluster.client import make_request
from loadtest.cluster_process import process_role, running_server, tree_processes
from loadtest.serve_voxray import loadtest_config
from loadtest.workload import load_prompts, max_tokens_for
from protos import voxray_pb2_grpc

SETTLE_S = 2.0  # after a burst, before its sample


def replica_rss_mb(root_pid: int) -> dict[str, float]:
    """RSS (MB) of each stage replica of the server's tree, named `Stage[pid]`."""
    out = {}
    for proc in tree_processes(root_pid):
        try:
            role = process_role(proc, root_pid)
            if "Stage" in role:
                out[f"{role.split(':')[-1]}[{proc.pid}]"] = round(proc.memory_info().rss / 1e6, 1)
        except psutil.Error:  # a process may end between listing and reading
            pass
    return out


def play(stub, app_name: str, text: str, seed: int, outcomes: list[str]) -> None:
    """One stream to its end; its outcome (`ok` or the gRPC code) appended."""
    sampling = {"seed": seed, "max_tokens": max_tokens_for(text)}
    request = make_request(text, voice="tara", request_id=f"probe-{seed}-{random.random()}", sampling=sampling)
    try:
        for _ in stub.Synthesize(request, metadata=(("application", app_name),), timeout=120):
            pass
        outcomes.append("ok")
    except grpc.RpcError as err:
        outcomes.append(err.code().name)


def burst(stub, app_name: str, prompts: list[str], concurrency: int, rng: random.Random) -> dict[str, int]:
    outcomes: list[str] = []
    threads = []
    for i in range(concurrency):
        text = prompts[rng.randrange(len(prompts))]
        threads.append(threading.Thread(target=play, args=(stub, app_name, text, i, outcomes)))
        threads[-1].start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    return {code: outcomes.count(code) for code in set(outcomes)}


def probe(warm_up: bool, port: int, bursts: list[int], scratch: Path) -> list[dict]:
    config = loadtest_config(port, port + 1)
    config = config.model_copy(update={"engine": config.engine.model_copy(update={"warm_up": warm_up})})
    prompts, rng = load_prompts(), random.Random(3)
    rows = []
    with running_server(config, scratch) as server:
        stub = voxray_pb2_grpc.SpeechStub(grpc.insecure_channel(server.grpc_target))
        time.sleep(3)
        rows.append({"burst": "ready", "rss_mb": replica_rss_mb(server.proc.pid), "outcomes": {}})
        for concurrency in bursts:
            outcomes = burst(stub, config.app_name, prompts, concurrency, rng)
            time.sleep(SETTLE_S)
            rows.append({"burst": concurrency, "rss_mb": replica_rss_mb(server.proc.pid), "outcomes": outcomes})
            print(f"warm_up={warm_up} burst={concurrency}", rows[-1]["rss_mb"], outcomes, flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, nargs="+", default=[1, 2, 4, 8, 12, 12, 4, 12, 12])
    parser.add_argument("--grpc-port", type=int, default=19400)
    parser.add_argument("--out", type=Path, default=Path("bench_out/warm_up_probe.json"))
    args = parser.parse_args(argv)
    report = {
        f"warm_up={warm}": probe(warm, args.grpc_port + 10 * warm, args.bursts, args.out.parent / f"scratch-{warm}")
        for warm in (False, True)
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

"""Graceful-stop benchmark: a real `voxray serve` (the embedded default on its own ports) with N
streams playing gets SIGTERM; reports how each stream ended, the drain time the server printed,
and the time from the signal to the process exit.

Usage: python -m loadtest.drain_bench --streams 8 --max-tokens 700 --grace-s 25
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import yaml

from core.config import DrainConfig, ServeConfig
from loadtest.sweep import wait_ready

ROOT = Path(__file__).resolve().parents[1]


def _run_stream(target: str, name: str, max_tokens: int, outcomes: dict) -> None:
    from cluster.client import open_channel
    from protos import voxray_pb2, voxray_pb2_grpc

    request = voxray_pb2.SynthesizeRequest(text=f"drain benchmark {name}", request_id=name,
                                           sampling=voxray_pb2.SamplingOptions(max_tokens=max_tokens))  # fmt: skip
    with open_channel(target) as channel:
        try:
            for _ in voxray_pb2_grpc.SpeechStub(channel).Synthesize(request, timeout=300):
                pass
            outcomes[name] = "OK"
        except grpc.RpcError as err:
            outcomes[name] = err.code().name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=7 * 100)
    p.add_argument("--grace-s", type=float, default=25.0)
    p.add_argument("--signal-after-s", type=float, default=1.0)
    p.add_argument("--grpc-port", type=int, default=19240)
    p.add_argument("--http-port", type=int, default=19241)
    args = p.parse_args(argv)
    config = ServeConfig(grpc_port=args.grpc_port, http_port=args.http_port, drain=DrainConfig(grace_s=args.grace_s))
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "serve.yaml"
        path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
        log = Path(scratch) / "serve.log"
        command = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(path)]
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        target = f"127.0.0.1:{args.grpc_port}"
        wait_ready(target, "voxray", 240.0)
        outcomes: dict[str, str] = {}
        names = [f"drain-{i}" for i in range(args.streams)]
        threads = [threading.Thread(target=_run_stream, args=(target, n, args.max_tokens, outcomes)) for n in names]
        for thread in threads:
            thread.start()
        time.sleep(args.signal_after_s)
        signalled_s = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=args.grace_s + 60)
        exit_code = proc.wait(timeout=args.grace_s + 60)
        exited_s = time.monotonic() - signalled_s
        drained = re.search(r"drained in ([0-9.]+) s", log.read_text())
    print(f"{args.streams} streams x {args.max_tokens} tokens, SIGTERM after {args.signal_after_s} s: "
          f"{dict(Counter(outcomes.values()))}; drain {drained.group(1) if drained else '?'} s; "
          f"signal -> exit {exited_s:.1f} s (exit code {exit_code})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

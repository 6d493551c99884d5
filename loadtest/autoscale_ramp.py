"""A load ramp up and down against a Serve app, with its replicas counted: SLO autoscaling vs a
fixed replica count (issue 40), on a local Ray.

The load is closed-loop users (Locust's LoadTestShape: a user count per stage): user i streams one
request after another while the stage's count is above i, finishing its stream when it drops. A
sampler reads the deployments' replica states from Serve's controller. The result: each stream's
outcome (ok, viable, which LLM replicas served it), the LLM replica trajectory (1 -> 2 -> 1),
replica-seconds per stage, and the SLO policy's decision series scraped from Prometheus.
`python -m loadtest.autoscale_ramp --out ramp.json` runs the comparison (an autoscaled app, then
a fixed one at its max replicas, on one Ray); `--short` the small ramp the cluster test drives.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from cluster.client import make_request
from core.config import AdmissionConfig, ServeConfig, SLOScalingConfig, StageDeploymentConfig
from loadtest.metrics import RequestRecord, is_viable, percentile, ttfa_s
from protos import voxray_pb2_grpc

TEXT = "The quick brown fox jumps over the lazy dog while the band plays on."
DECISION_SERIES = "ray_voxray_autoscale_decisions"
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\}\s+([-+0-9.eEinfINFaN]+)")


@dataclass(frozen=True)
class RampStage:
    duration_s: float  # how long the stage lasts (the last one: until scaled back down, at most this)
    users: int  # streams kept playing at once


@dataclass(frozen=True)
class RampConfig:
    stages: tuple[RampStage, ...]
    max_tokens: int  # each stream's length (7 tokens per frame, ~85 ms of audio a frame)
    app_name: str
    request_timeout_s: float = 120.0
    sample_s: float = 0.5
    end_at_replicas: int | None = None  # the last stage ends once the LLM stage runs this many (autoscaled)


@dataclass
class StreamResult:
    user: int
    started_s: float  # since the ramp's start
    ended_s: float
    record: RequestRecord
    llm_replicas: list[str] = field(default_factory=list)  # in order served (two: moved mid-stream)


@dataclass
class RampResult:
    label: str
    streams: list[StreamResult]
    samples: list[tuple[float, int, int, int, int]]  # (s, LLM running, LLM held, detok running, detok held)
    decisions: dict[str, float] = field(default_factory=dict)  # "LLMStage up pressure_high" -> count
    wall_s: float = 0.0

    def llm_trajectory(self) -> list[int]:
        """The LLM stage's running replica counts, each change once (e.g. [1, 2, 1])."""
        counts = [running for _, running, _, _, _ in self.samples if running > 0]
        return [c for i, c in enumerate(counts) if i == 0 or counts[i - 1] != c]

    def replica_seconds(self, column: int) -> float:
        """Integral of a sampled count over the ramp (column 2: LLM replicas held, 4: detok)."""
        pairs = zip(self.samples, self.samples[1:], strict=False)  # each sample to the next
        return sum((b[0] - a[0]) * a[column] for a, b in pairs)

    def summary(self) -> dict:
        records = [s.record for s in self.streams]
        ok = [r for r in records if r.is_ok]
        ttfas = [t for r in ok if (t := ttfa_s(r.arrivals_s, r.durations_s)) is not None]
        p90 = percentile(ttfas, 90)
        return {
            "label": self.label,
            "streams": len(records),
            "failed": len(records) - len(ok),
            "pct_viable": round(100.0 * sum(is_viable(r) for r in records) / max(1, len(records)), 1),
            "ttfa_p90_s": round(p90, 3) if p90 is not None else None,
            "moved_streams": sum(len(set(s.llm_replicas)) > 1 for s in self.streams),
            "llm_trajectory": self.llm_trajectory(),
            "llm_replica_s": round(self.replica_seconds(2), 1),
            "detok_replica_s": round(self.replica_seconds(4), 1),
            "decisions": self.decisions,
            "wall_s": round(self.wall_s, 1),
        }


def replica_counts(app_name: str) -> tuple[int, int, int, int]:
    """(running, held) replicas of LLMStage and of DetokStage: held counts every state that holds
    resources (starting, running, stopping), for replica-seconds."""
    from ray import serve

    deployments = serve.status().applications[app_name].deployments
    counts: list[int] = []
    for name in ("LLMStage", "DetokStage"):
        states = deployments[name].replica_states if name in deployments else {}
        counts += [states.get("RUNNING", 0), sum(states.values())]
    return counts[0], counts[1], counts[2], counts[3]


def run_stream(stub: voxray_pb2_grpc.SpeechStub, cfg: RampConfig, seed: int) -> tuple[RequestRecord, list[str]]:
    """One stream: chunk arrivals and durations, and the LLM replicas that served it."""
    record, replicas = RequestRecord(text_chars=len(TEXT)), []
    request = make_request(TEXT, voice="tara", sampling={"max_tokens": cfg.max_tokens, "seed": seed})
    start = time.perf_counter()
    try:
        metadata = (("application", cfg.app_name),)
        for chunk in stub.Synthesize(request, metadata=metadata, timeout=cfg.request_timeout_s):
            record.arrivals_s.append(time.perf_counter() - start)
            record.durations_s.append(chunk.duration_s)
            if not replicas or replicas[-1] != chunk.llm_replica:
                replicas.append(chunk.llm_replica)
    except grpc.RpcError as err:
        record.is_ok, record.error = False, err.code().name
    return record, replicas


class Ramp:
    """Drives the users and the sampler of one ramp."""

    def __init__(self, target: str, cfg: RampConfig) -> None:
        self.target, self.cfg = target, cfg
        self.users = 0  # the current stage's user count (read by the user threads)
        self.is_over = False  # users stop starting streams
        self.is_sampling = True  # until the users' last streams ended
        self.streams: list[StreamResult] = []
        self.samples: list[tuple[float, int, int, int, int]] = []
        self.lock = threading.Lock()
        self.t0 = time.monotonic()

    def _user(self, index: int) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub, num = voxray_pb2_grpc.SpeechStub(channel), 0
            while not self.is_over:
                if self.users <= index:
                    time.sleep(0.1)
                    continue
                started_s = time.monotonic() - self.t0
                record, replicas = run_stream(stub, self.cfg, seed=index * 1000 + num)
                num += 1
                result = StreamResult(index, started_s, time.monotonic() - self.t0, record, replicas)
                with self.lock:
                    self.streams.append(result)

    def _sample(self) -> None:
        while self.is_sampling:
            try:
                counts = replica_counts(self.cfg.app_name)
                self.samples.append((time.monotonic() - self.t0, *counts))
            except Exception:  # the controller is busy: the next sample counts
                pass
            time.sleep(self.cfg.sample_s)

    def _stage_over(self, stage: RampStage, last: bool, started_s: float) -> bool:
        """A stage lasts its duration; the last one of an autoscaled ramp ends sooner once the LLM
        stage, having scaled past `end_at_replicas`, holds exactly that many again."""
        if time.monotonic() - started_s >= stage.duration_s:
            return True
        wanted = self.cfg.end_at_replicas
        if not last or wanted is None or not self.samples:
            return False
        _, running, held, _, _ = self.samples[-1]
        return running == held == wanted and any(sample[1] > wanted for sample in self.samples)

    def run(self) -> tuple[list[StreamResult], list[tuple[float, int, int, int, int]]]:
        max_users = max(stage.users for stage in self.cfg.stages)
        threads = [threading.Thread(target=self._user, args=(i,), daemon=True) for i in range(max_users)]
        threads.append(threading.Thread(target=self._sample, daemon=True))
        for thread in threads:
            thread.start()
        for i, stage in enumerate(self.cfg.stages):
            self.users, started_s = stage.users, time.monotonic()
            while not self._stage_over(stage, i == len(self.cfg.stages) - 1, started_s):
                time.sleep(self.cfg.sample_s)
        self.users, self.is_over = 0, True
        for thread in threads[:-1]:  # users finish the stream they play, then stop
            thread.join(timeout=self.cfg.request_timeout_s)
        self.is_sampling = False
        threads[-1].join(timeout=5.0)
        return self.streams, self.samples


def scrape_decisions(metrics_port: int, app_name: str) -> dict[str, float]:
    """The SLO policy's decision counts of `app_name` from Ray's Prometheus endpoint."""
    import requests

    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10.0).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or not match.group(1).startswith(DECISION_SERIES):
            continue
        tags = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if tags.get("application") == app_name:
            key = f"{tags.get('deployment')} {tags.get('action')} {tags.get('reason')}"
            counts[key] = max(counts.get(key, 0.0), float(match.group(3)))
    return counts


def run_ramp(target: str, cfg: RampConfig, label: str, metrics_port: int | None = None) -> RampResult:
    """Run the ramp against a deployed app (this driver joined its Ray)."""
    t0 = time.monotonic()
    streams, samples = Ramp(target, cfg).run()
    decisions = scrape_decisions(metrics_port, cfg.app_name) if metrics_port is not None else {}
    return RampResult(label, sorted(streams, key=lambda s: s.started_s), samples, decisions, time.monotonic() - t0)


def ramp_app_config(base: ServeConfig, autoscale: bool, max_llm: int, slo: SLOScalingConfig) -> ServeConfig:
    """`base` with its LLM stage autoscaled by the SLO policy (1..max_llm) or fixed at max_llm. Admission
    counts streams against the KV cap (fixed_cap), so a stream weighs the same on any busy box."""
    if autoscale:
        llm = base.llm.model_copy(update={"autoscaling": True, "min_replicas": 1, "max_replicas": max_llm,
                                          "autoscaling_policy": "slo", "slo": slo})  # fmt: skip
    else:
        llm = base.llm.model_copy(update={"autoscaling": False, "num_replicas": max_llm})
    admission = base.admission.model_copy(update={"policy": "fixed_cap"})
    return base.model_copy(update={"llm": llm, "admission": admission})


SHORT = RampConfig(
    stages=(RampStage(45.0, 4), RampStage(60.0, 2)), max_tokens=7 * 48, app_name="", end_at_replicas=1
)  # fmt: skip
FULL = RampConfig(
    stages=(RampStage(30.0, 1), RampStage(60.0, 4), RampStage(60.0, 6), RampStage(60.0, 2), RampStage(60.0, 1)),
    max_tokens=7 * 96, app_name="",
)  # fmt: skip
RAMP_SLO = SLOScalingConfig(
    ttfa_target_s=30.0, stream_use_target=0.5, scale_up_pressure=0.9, scale_down_pressure=0.6,
    sustain_s=1.0, up_cooldown_s=0.0, down_cooldown_s=5.0, look_back_s=11.0,
)  # fmt: skip
RAMP_STAGE = StageDeploymentConfig(num_cpus=0.25)
RAMP_ADMISSION = AdmissionConfig(max_streams_per_replica=8, max_queued_per_replica=8, default_ttfa_deadline_s=60.0)


def _run_app(config: ServeConfig, cfg: RampConfig, label: str, metrics_port: int, first: bool) -> RampResult:
    """Deploy `config` (the first app starts Ray and Serve), run the ramp on it, delete it."""
    from ray import serve

    from cluster.server import deploy, deploy_app
    from loadtest.sweep import wait_ready

    endpoints = (
        deploy(config, num_cpus=4, metrics_export_port=metrics_port, quiet=True) if first else deploy_app(config)
    )
    try:
        wait_ready(endpoints.grpc_target, config.app_name)
        return run_ramp(endpoints.grpc_target, cfg, label, metrics_port)
    finally:
        serve.delete(config.app_name)


def main(argv: list[str] | None = None) -> list[dict]:
    import os

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="the cluster test's small ramp")
    parser.add_argument("--max-llm", type=int, default=2, help="LLM replicas: the autoscaler's max, the fixed count")
    parser.add_argument("--grpc-port", type=int, default=19500)
    parser.add_argument("--http-port", type=int, default=18500)
    parser.add_argument("--metrics-port", type=int, default=18580)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")  # Ray's default: 10 s
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    from cluster.server import shutdown

    shape, rows = SHORT if args.short else FULL, []
    base = ServeConfig(app_name="voxray-ramp", grpc_port=args.grpc_port, http_port=args.http_port,
                       llm=RAMP_STAGE, detok=RAMP_STAGE, admission=RAMP_ADMISSION)  # fmt: skip
    for autoscale in (True, False):
        config = ramp_app_config(base, autoscale, args.max_llm, RAMP_SLO)
        cfg = replace(shape, app_name=config.app_name, end_at_replicas=shape.end_at_replicas if autoscale else None)
        label = "autoscaled (slo)" if autoscale else f"fixed {args.max_llm} LLM replicas"
        rows.append(_run_app(config, cfg, label, args.metrics_port, first=autoscale).summary())
        print(json.dumps(rows[-1]), flush=True)
    shutdown(reap=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()

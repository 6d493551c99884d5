"""Locust user for the `voxray.Speech` gRPC streaming API, with a shape stepping the request rate.

Each request fires Locust request events: `ttfa`, `total`, `chunk_lateness` (per audio chunk) and
`viable` (a failure when any chunk was late). Loopback targets only unless --allow-remote.
Closed loop per user (use loadtest.sweep for open loop). `make locust` runs it headless with CSV.
"""

from __future__ import annotations

import math
import random
import time

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpc's C core must cooperate with gevent before any channel exists

import grpc  # noqa: E402
from locust import LoadTestShape, User, constant_throughput, events, task  # noqa: E402

from cluster.client import make_request  # noqa: E402
from loadtest.metrics import RequestRecord, chunk_lateness_s, is_viable, ttfa_s  # noqa: E402
from loadtest.workload import check_target, load_prompts, max_tokens_for  # noqa: E402
from protos import voxray_pb2_grpc  # noqa: E402

PROMPTS = load_prompts()


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    parser.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.5, 1.0], help="req/s per step")
    parser.add_argument("--step-s", type=float, default=30.0, help="seconds per rate step")
    parser.add_argument("--per-user-rps", type=float, default=0.1, help="one user sends at most this rate")
    parser.add_argument("--app", default="voxray", help="Serve application name (gRPC metadata)")
    parser.add_argument("--voice", default="tara")
    parser.add_argument("--request-timeout-s", type=float, default=60.0)
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host")


class SpeechUser(User):
    """One client: sends a bundled prompt, consumes the stream, reports DESIGN §1 metrics."""

    def wait_time(self) -> float:
        return constant_throughput(self.environment.parsed_options.per_user_rps)(self)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        check_target(self.host, options.allow_remote)
        self.channel = grpc.insecure_channel(self.host)
        self.stub = voxray_pb2_grpc.SpeechStub(self.channel)
        self.rng = random.Random()

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def synthesize(self) -> None:
        options = self.environment.parsed_options
        text = PROMPTS[self.rng.randrange(len(PROMPTS))]
        request = make_request(text, voice=options.voice, sampling={"max_tokens": max_tokens_for(text)})
        record, error = RequestRecord(text_chars=len(text)), None
        start = time.perf_counter()
        try:
            metadata = (("application", options.app),)
            for chunk in self.stub.Synthesize(request, metadata=metadata, timeout=options.request_timeout_s):
                record.arrivals_s.append(time.perf_counter() - start)
                record.durations_s.append(chunk.duration_s)
        except grpc.RpcError as err:
            record.is_ok, record.error, error = False, err.code().name, err
        self._report(record, error)

    def _report(self, record: RequestRecord, error: Exception | None) -> None:
        fire = self.environment.events.request.fire
        audio_bytes = int(sum(record.durations_s) * 24000 * 2)
        total_ms = 1000 * (record.arrivals_s[-1] if record.arrivals_s else 0.0)
        fire(request_type="grpc", name="total", response_time=total_ms, response_length=audio_bytes, exception=error)
        first = ttfa_s(record.arrivals_s, record.durations_s)
        if first is not None:
            fire(request_type="grpc", name="ttfa", response_time=1000 * first, response_length=0, exception=None)
        for late in chunk_lateness_s(record.arrivals_s, record.durations_s):
            late_exc = RuntimeError("chunk late") if late > 0 else None
            fire(request_type="grpc", name="chunk_lateness", response_time=1000 * max(0.0, late),
                 response_length=0, exception=late_exc)  # fmt: skip
        viable_exc = None if is_viable(record) else RuntimeError(record.error or "underrun")
        fire(request_type="grpc", name="viable", response_time=total_ms, response_length=0, exception=viable_exc)


class StepRateShape(LoadTestShape):
    """Steps the offered rate through --rates, --step-s each: users = rate / --per-user-rps."""

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        step = int(self.get_run_time() // options.step_s)
        if step >= len(options.rates):
            return None
        users = max(1, math.ceil(options.rates[step] / options.per_user_rps))
        return users, float(users)

"""gRPC helpers for the cluster tests: run one stream, collect chunks, or capture the error."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from cluster.client import make_request
from protos import voxray_pb2_grpc


@dataclass
class StreamOutcome:
    chunks: list = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    trailers: dict = field(default_factory=dict)
    arrivals_s: list = field(default_factory=list)  # time.monotonic() of each chunk
    finished_after_s: float = 0.0

    @property
    def pcm16(self) -> bytes:
        return b"".join(c.audio for c in self.chunks)


def retry_delay_s(trailers: dict) -> float | None:
    """The RetryInfo delay in a gRPC error's `grpc-status-details-bin` (None when absent)."""
    from google.rpc.error_details_pb2 import RetryInfo
    from google.rpc.status_pb2 import Status

    raw = trailers.get("grpc-status-details-bin")
    if raw is None:
        return None
    for detail in Status.FromString(raw).details:
        info = RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


def run_stream(target: str, app: str, text: str, outcome: StreamOutcome | None = None, **kwargs) -> StreamOutcome:
    """Stream one request to the end; `outcome` (given) fills in as chunks arrive, for a watcher."""
    outcome = outcome if outcome is not None else StreamOutcome()
    start = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        try:
            for chunk in stub.Synthesize(make_request(text, **kwargs), metadata=(("application", app),), timeout=240):
                outcome.chunks.append(chunk)
                outcome.arrivals_s.append(time.monotonic())
        except grpc.RpcError as err:
            outcome.code, outcome.details = err.code(), err.details() or ""
            outcome.trailers = dict(err.trailing_metadata() or ())
    outcome.finished_after_s = time.monotonic() - start
    return outcome

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
    finished_after_s: float = 0.0

    @property
    def pcm16(self) -> bytes:
        return b"".join(c.audio for c in self.chunks)


def run_stream(target: str, app: str, text: str, **kwargs) -> StreamOutcome:
    outcome = StreamOutcome()
    start = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        try:
            for chunk in stub.Synthesize(make_request(text, **kwargs), metadata=(("application", app),), timeout=240):
                outcome.chunks.append(chunk)
        except grpc.RpcError as err:
            outcome.code, outcome.details = err.code(), err.details() or ""
    outcome.finished_after_s = time.monotonic() - start
    return outcome

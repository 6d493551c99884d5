"""gRPC client for the `voxray.Speech` service (`voxray say`, tests, load tests).

`stream_synthesis` sends one request and yields (arrival time, AudioChunk message); it
measures client-side TTFA from the send to the first non-empty chunk. `transcribe` is the unary
`Transcribe`; `wav_input` reads a WAV file as a speech-in request's audio.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos import voxray_pb2, voxray_pb2_grpc
from router.audio_format import wav_bytes


@dataclass
class SynthesisResult:
    pcm16: bytes = b""
    sample_rate_hz: int = 0
    chunk_arrivals_s: list[float] = field(default_factory=list)  # since the send
    chunk_durations_s: list[float] = field(default_factory=list)
    server_ttfa_s: float = 0.0
    text: str = ""  # speech in: the answer's text (its transcript, or a text-only answer)

    @property
    def ttfa_s(self) -> float | None:
        for arrival, duration in zip(self.chunk_arrivals_s, self.chunk_durations_s, strict=True):
            if duration > 0:
                return arrival
        return None


def make_request(text: str, **kwargs) -> voxray_pb2.SynthesizeRequest:
    sampling = kwargs.pop("sampling", None) or {}
    return voxray_pb2.SynthesizeRequest(text=text, sampling=voxray_pb2.SamplingOptions(**sampling), **kwargs)


def stream_synthesis(
    stub: voxray_pb2_grpc.SpeechStub, request: voxray_pb2.SynthesizeRequest, app_name: str, timeout_s: float = 300.0
) -> Iterator[tuple[float, voxray_pb2.AudioChunk]]:
    start = time.perf_counter()
    for chunk in stub.Synthesize(request, metadata=(("application", app_name),), timeout=timeout_s):
        yield time.perf_counter() - start, chunk


def open_channel(target: str, root_certificates: bytes | None = None) -> grpc.Channel:
    """A channel to `target`: TLS verified against `root_certificates` (PEM) when given, else plaintext."""
    if root_certificates is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates))


def synthesize(
    target: str, app_name: str, request: voxray_pb2.SynthesizeRequest, root_certificates: bytes | None = None
) -> SynthesisResult:
    result = SynthesisResult()
    with open_channel(target, root_certificates) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        for arrival, chunk in stream_synthesis(stub, request, app_name):
            result.pcm16 += chunk.audio
            result.sample_rate_hz = chunk.sample_rate_hz
            result.chunk_arrivals_s.append(arrival)
            result.chunk_durations_s.append(chunk.duration_s)
            result.server_ttfa_s = chunk.timings.ttfa_s or result.server_ttfa_s
            result.text += chunk.text
    return result


def transcribe(
    target: str, app_name: str, request: voxray_pb2.TranscribeRequest, root_certificates: bytes | None = None,
    timeout_s: float = 300.0,
) -> voxray_pb2.TranscribeResponse:
    """A clip's transcript (gRPC `Transcribe`)."""
    with open_channel(target, root_certificates) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        return stub.Transcribe(request, metadata=(("application", app_name),), timeout=timeout_s)


def wav_input(path: Path) -> voxray_pb2.InputAudio:
    """A WAV file as a request's audio (the server decodes, mixes to mono and resamples it)."""
    return voxray_pb2.InputAudio(data=path.read_bytes(), format=voxray_pb2.INPUT_AUDIO_WAV)


def list_models(target: str, app_name: str, timeout_s: float = 10.0) -> list[voxray_pb2.ModelInfo]:
    """What a running server serves (gRPC `ListModels`), the default model first."""
    with open_channel(target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        response = stub.ListModels(voxray_pb2.ListModelsRequest(), metadata=(("application", app_name),),
                                   timeout=timeout_s)  # fmt: skip
    return list(response.models)


def result_wav(result: SynthesisResult) -> bytes:
    return wav_bytes(result.pcm16, result.sample_rate_hz)

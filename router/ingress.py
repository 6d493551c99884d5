"""Router deployment: the ingress for gRPC (`voxray.Speech`) and HTTP (OpenAI `/v1/audio/speech`).

It validates requests, dispatches them to an LLMStage replica (picked by `PredictedTTFARouter`),
fetches each chunk's audio from the detok replica's object store in seq order (the LLM replica
forwards only an `AudioRef`) and streams it out, mapping admission results
to RESOURCE_EXHAUSTED / 429 and bad input to INVALID_ARGUMENT / 400 naming the field.
"""

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from core.config import ServeConfig
from core.errors import InvalidArgumentError
from core.messages import Admitted, AudioChunk, AudioReady, Failed, Invalid, Job, Queued, Rejected, StreamHead
from llm_stage.registry import ModelEntry, get_entry
from protos import voxray_pb2
from router.audio_format import streaming_wav_header
from router.dispatch import estimated_loads
from router.jobs import job_from_fields, sampling_from_proto
from router.metrics import RouterMetrics
from router.playback import PlaybackTracker

http_app = FastAPI(title="VoxRay")


class AdmissionRejected(Exception):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"server at capacity; retry after {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


class StreamFailed(Exception):
    """The stream broke inside the cluster (a Failed event, or a stream that ended early)."""


@dataclass
class SentChunk:
    audio: AudioChunk
    seq: int
    ttfa_s: float | None
    elapsed_s: float
    llm_replica: str = ""


class RouterCore:
    """Transport-independent part of the router: validation, dispatch, ordered streaming."""

    def __init__(self, config: dict, llm_handle) -> None:
        self.config = ServeConfig.model_validate(config)
        self.entry = get_entry(self.config.engine.model.name)
        self.llm = llm_handle.options(stream=True)
        self.open_streams = 0
        self.metrics = RouterMetrics()

    def job(self, **fields) -> Job:
        return job_from_fields(self.entry, self.config.admission, **fields)

    def check_capacity(self) -> None:
        """Reject at once when the LLM replicas known here are full: by their reported load, or by
        the streams this router has open itself (a burst arrives before any stats refresh)."""
        loads = estimated_loads(self.config.app_name)
        if not loads:
            return
        capacity = sum(load.max_streams + load.max_queued for load in loads)
        active = max(self.open_streams, sum(load.num_active for load in loads))
        if active >= capacity:
            self.metrics.rejections.inc()
            raise AdmissionRejected(self.config.admission.retry_after_s)

    async def run(self, job: Job) -> AsyncIterator[SentChunk]:
        self.check_capacity()
        self.open_streams += 1
        try:
            async for sent in self._dispatch(job):
                yield sent
        finally:
            self.open_streams -= 1

    async def _dispatch(self, job: Job) -> AsyncIterator[SentChunk]:
        tracker = PlaybackTracker(time.monotonic())
        stream = self.llm.generate.remote(job)
        finished = False
        try:
            llm_replica = self._check_head(await stream.__anext__())
            async for event in stream:
                if isinstance(event, Failed):
                    raise StreamFailed(event.message)
                audio = await self._fetch(event)
                now = time.monotonic()
                underrun = tracker.on_chunk(now, audio.duration_s)
                if underrun is not None:
                    self.metrics.underrun.observe(underrun)
                finished = audio.is_final
                yield SentChunk(audio, audio.seq, tracker.ttfa_s, now - tracker.start_s, llm_replica)
                if finished:
                    self._record_finished(tracker, now)
                    return
            raise StreamFailed("stream ended without a final chunk")
        finally:
            if not finished:
                stream.cancel()

    @staticmethod
    async def _fetch(event: AudioReady) -> AudioChunk:
        """The chunk's audio, straight from the detok replica's object store."""
        try:
            return await event.ref.handle
        except Exception as err:  # the detok replica died holding it
            raise StreamFailed(f"audio of chunk {event.ref.seq} lost: {type(err).__name__}") from err

    def _record_finished(self, tracker: PlaybackTracker, now_s: float) -> None:
        metrics = self.metrics
        metrics.finished.inc()
        if tracker.ttfa_s is not None:
            metrics.ttfa.observe(tracker.ttfa_s)
        if tracker.is_viable:
            metrics.viable.inc()
        metrics.audio.inc(tracker.audio_sent_s)
        metrics.realtime.set(tracker.audio_sent_s / max(now_s - tracker.start_s, 1e-6))

    def _check_head(self, head: StreamHead | AudioReady) -> str:
        """The replica serving the job; raises for a head that refuses it."""
        match head:
            case Admitted(llm_replica=replica) | Queued(llm_replica=replica):
                return replica
            case Rejected(retry_after_s=retry_after_s):
                self.metrics.rejections.inc()
                raise AdmissionRejected(retry_after_s)
            case Invalid(field=field, message=message):
                raise InvalidArgumentError(field, message)
            case Failed(message=message):
                raise StreamFailed(message)
        raise StreamFailed(f"unexpected stream head {type(head).__name__}")


def models_response(entry: ModelEntry) -> voxray_pb2.ListModelsResponse:
    info = voxray_pb2.ModelInfo(name=entry.name, description=entry.description, sample_rate_hz=entry.sample_rate_hz)
    return voxray_pb2.ListModelsResponse(models=[info])


def voices_response(entry: ModelEntry) -> voxray_pb2.ListVoicesResponse:
    """The voices the served family accepts (none for families without voices) and its default."""
    return voxray_pb2.ListVoicesResponse(voices=list(entry.voices), default_voice=entry.default_voice or "")


def _to_proto(job: Job, sent: SentChunk, header: bytes) -> voxray_pb2.AudioChunk:
    audio = sent.audio
    return voxray_pb2.AudioChunk(
        request_id=job.req_id,
        seq=sent.seq,
        audio=header + audio.pcm16,
        sample_rate_hz=audio.sample_rate_hz,
        duration_s=audio.duration_s,
        final=audio.is_final,
        timings=voxray_pb2.ServerTimings(
            ttfa_s=sent.ttfa_s or 0.0,
            elapsed_s=sent.elapsed_s,
            chunk_ready_unix_s=audio.hops.chunk_ready_unix_s,
            detok_received_unix_s=audio.hops.detok_received_unix_s,
            audio_ready_unix_s=audio.hops.audio_ready_unix_s,
            router_sent_unix_s=time.time(),
        ),
        llm_replica=sent.llm_replica,
        detok_replica=audio.detok_replica,
    )


async def _http_body(first: SentChunk, rest: AsyncIterator[SentChunk], header: bytes) -> AsyncIterator[bytes]:
    yield header + first.audio.pcm16
    async for sent in rest:
        yield sent.audio.pcm16


OPENAI_FORMATS = {"pcm": "pcm16", "wav": "wav"}


async def _speech_fields(request: Request) -> dict:
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type != "application/json":
        raise InvalidArgumentError("content-type", f"expected application/json, got {content_type or 'nothing'!r}")
    try:
        body = await request.json()
    except ValueError:
        raise InvalidArgumentError("body", "is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    unknown = set(body) - {"model", "input", "voice", "response_format", "stream", "speed", "sampling", "request_id"}
    if unknown:
        raise InvalidArgumentError(sorted(unknown)[0], "unknown field")
    fmt = body.get("response_format", "wav")
    if fmt not in OPENAI_FORMATS:
        raise InvalidArgumentError("response_format", f"{fmt!r} is not served; use one of: pcm, wav")
    if body.get("speed", 1.0) != 1.0:
        raise InvalidArgumentError("speed", "only 1.0 is served")
    text, sampling = body.get("input"), body.get("sampling") or {}
    if not isinstance(text, str) or not isinstance(sampling, dict):
        raise InvalidArgumentError("input" if not isinstance(text, str) else "sampling", "has the wrong type")
    return {
        "text": text, "model": str(body.get("model") or ""), "voice": str(body.get("voice") or ""),
        "sampling": sampling, "output_format": OPENAI_FORMATS[fmt], "sample_rate_hz": 0, "ttfa_deadline_s": 0.0,
        "req_id": str(body.get("request_id") or ""), "text_field": "input",
    }  # fmt: skip


def _http_error(status: int, message: str, param: str | None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param}}
    return JSONResponse(body, status_code=status, headers=headers)


class GrpcAbort(Exception):
    """Raised after setting the status on the context; Serve then answers with that code."""


def _abort(grpc_context, code: grpc.StatusCode, details: str, retry_after_s: float | None = None) -> None:
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(details)
        if retry_after_s is not None:
            grpc_context.set_trailing_metadata([("retry-after-s", f"{retry_after_s:.1f}")])
    raise GrpcAbort(f"{code.name}: {details}")


# Defined last: serve.ingress freezes the FastAPI app (and these methods) at class creation,
# so every helper they use must already exist; no postponed annotations in this module.
@serve.ingress(http_app)
class Router:
    """Serve ingress class (FastAPI routes + gRPC methods); deployed by `deployments.app`."""

    def __init__(self, config: dict, llm_handle) -> None:
        self.core = RouterCore(config, llm_handle)

    # ---- gRPC -----------------------------------------------------------------------------
    async def Synthesize(self, request: voxray_pb2.SynthesizeRequest, grpc_context=None):  # noqa: N802
        try:
            job = self.core.job(
                text=request.text, model=request.model, voice=request.voice,
                sampling=sampling_from_proto(request.sampling), sample_rate_hz=request.sample_rate_hz,
                output_format="wav" if request.format == voxray_pb2.AUDIO_FORMAT_WAV else "pcm16",
                ttfa_deadline_s=request.ttfa_deadline_s, req_id=request.request_id,
            )  # fmt: skip
            header = streaming_wav_header(self.core.entry.sample_rate_hz) if job.output_format == "wav" else b""
            async for sent in self.core.run(job):
                yield _to_proto(job, sent, header if sent.seq == 0 else b"")
        except InvalidArgumentError as err:
            _abort(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except AdmissionRejected as err:
            _abort(grpc_context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(err), err.retry_after_s)
        except StreamFailed as err:
            _abort(grpc_context, grpc.StatusCode.INTERNAL, f"synthesis failed: {err}")

    async def ListModels(self, request: voxray_pb2.ListModelsRequest, grpc_context=None):  # noqa: N802
        return models_response(self.core.entry)

    async def ListVoices(self, request: voxray_pb2.ListVoicesRequest, grpc_context=None):  # noqa: N802
        entry = self.core.entry
        if request.model and request.model != entry.name:
            _abort(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, f"model: unknown model {request.model!r}")
        return voices_response(entry)

    # ---- HTTP -----------------------------------------------------------------------------
    @http_app.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok", "model": self.core.entry.name}

    @http_app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.core.entry.name, "object": "model"}]}

    @http_app.post("/v1/audio/speech")
    async def speech(self, request: Request) -> Response:
        try:
            job = self.core.job(**await _speech_fields(request))
            stream = self.core.run(job)
            first = await stream.__anext__()  # admission and validation happen before any byte is sent
        except InvalidArgumentError as err:
            param = err.field
            status = 415 if param == "content-type" else 400
            return _http_error(status, str(err), param)
        except AdmissionRejected as err:
            headers = {"Retry-After": str(max(1, round(err.retry_after_s)))}
            return _http_error(429, str(err), None, headers)
        except StreamFailed as err:
            return _http_error(500, f"synthesis failed: {err}", None)
        media = "audio/wav" if job.output_format == "wav" else "audio/pcm"
        header = streaming_wav_header(self.core.entry.sample_rate_hz) if job.output_format == "wav" else b""
        return StreamingResponse(
            _http_body(first, stream, header), media_type=media, headers={"X-Request-Id": job.req_id}
        )

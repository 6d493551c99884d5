"""Router deployment: the ingress for gRPC (`voxray.Speech`) and HTTP (OpenAI `/v1/audio/speech`).

It authenticates (`router.auth`), validates requests (`router.jobs`) and hands them to
`router.streams.RouterCore` (dispatch to an LLMStage replica, audio in seq order from the detok
replicas' object stores, resume, drain, incremental sessions), then streams the audio out.
Failures become a status and a short message with the request id (`router.replies`):
UNAUTHENTICATED / 401, INVALID_ARGUMENT / 400 naming the field, RESOURCE_EXHAUSTED / 429 with a
retry hint (a full replica, or a stream an LLM replica ran out of accelerator memory for),
DEADLINE_EXCEEDED for a gRPC deadline that cannot be met, INTERNAL / 500 without internals. A
stream that fails after admission is closed, so the LLM replica frees it. gRPC comes in through
the replica's own server (`router.grpc_server`), HTTP through Serve's proxy.
"""

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing, asynccontextmanager

import grpc
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf import any_pb2
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from google.rpc.status_pb2 import Status
from ray import serve
from ray.exceptions import RayError
from starlette.background import BackgroundTask

from core.config import ServeConfig, is_loopback
from core.errors import InvalidArgumentError
from core.messages import (
    Job,
)
from llm_stage.jobs import printable_name
from llm_stage.registry import ModelEntry
from protos import voxray_pb2
from router.audio_format import streaming_wav_header
from router.auth import ApiKeys, QuotaExceeded, Unauthenticated
from router.chat import ChatReply, chat_request, chat_sse_body, chat_whole
from router.deadlines import DeadlineUnmeetable
from router.grpc_converse import open_turn, read_turn
from router.grpc_converse import read_config as read_converse_config
from router.grpc_server import GrpcAbort, SpeechServer
from router.grpc_stream import read_config, stream_audio
from router.grpc_transcribe import transcribe_response, transcription_from_proto
from router.incremental import IdleTimeout
from router.jobs import (
    MAX_AUDIO_JSON_BYTES,
    MAX_BODY_BYTES,
    fields_from_proto,
    parse_proto,
    reply_request_id,
    speech_request,
)
from router.mic_turn import turn_job
from router.mic_websocket import MicEndpoint
from router.replica_listener import keep_replica_listener_on_loopback
from router.replies import Failure, http_error, log_failure, out_of_memory_retry_s, with_request_id
from router.served import ServedModels, models_json, models_response
from router.sse import MEDIA_TYPE as SSE_MEDIA_TYPE
from router.sse import audio_delta, audio_done, error_event, text_delta
from router.streams import (
    AdmissionRejected,
    Draining,
    ReplicasUnavailable,
    SentChunk,
    StreamFailed,
    replica_name,
)  # fmt: skip
from router.transcriptions import read_transcription_form, transcribe, transcription_job, transcription_response
from router.voices import MAX_HTTP_BODY_BYTES, VoiceRegistry, voice_request_from_json, voice_request_from_proto
from router.websocket import StreamEndpoint

http_app = FastAPI(title="VoxRay", docs_url=None, redoc_url=None, openapi_url=None)  # docs: ServeConfig.http_docs


def widest_host(config: ServeConfig) -> str:
    """The listen host of HTTP or gRPC that reaches furthest (for the open-server warning)."""
    return config.grpc_host if is_loopback(config.http_host) else config.http_host


def expose_docs(app: FastAPI) -> None:
    """Serve /docs, /redoc and /openapi.json (called once per replica, before its first request)."""
    if app.openapi_url is None:
        app.openapi_url, app.docs_url, app.redoc_url = "/openapi.json", "/docs", "/redoc"
        app.setup()


def voices_response(entry: ModelEntry) -> voxray_pb2.ListVoicesResponse:
    """The voices the served family accepts (none for families without voices) and its default."""
    return voxray_pb2.ListVoicesResponse(voices=list(entry.voices), default_voice=entry.default_voice or "")


def _to_proto(job: Job, sent: SentChunk, header: bytes) -> voxray_pb2.AudioChunk:
    audio = sent.audio
    if audio is None:  # speech in: the answer's text, ahead of its audio (seq: the next audio chunk's)
        return voxray_pb2.AudioChunk(
            request_id=job.req_id, seq=sent.seq, text=sent.text, llm_replica=sent.llm_replica,
            timings=voxray_pb2.ServerTimings(elapsed_s=sent.elapsed_s, router_sent_unix_s=time.time()),
        )  # fmt: skip
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


async def _grpc_chunks(
    job: Job, stream: AsyncIterator[SentChunk], header: bytes
) -> AsyncIterator[voxray_pb2.AudioChunk]:
    """`stream` as AudioChunks (`header` on the first audio); a text-only answer's text chunks are
    followed by a final one carrying no text, since the stream's end is known only after its last text."""
    llm_replica = ""
    async for sent in stream:
        yield _to_proto(job, sent, header if sent.seq == 0 and sent.audio is not None else b"")
        llm_replica = sent.llm_replica
    if job.text_only:
        timings = voxray_pb2.ServerTimings(router_sent_unix_s=time.time())
        yield voxray_pb2.AudioChunk(request_id=job.req_id, final=True, llm_replica=llm_replica, timings=timings)


async def _chunks(first: SentChunk | None, rest: AsyncIterator[SentChunk]) -> AsyncIterator[SentChunk]:
    """`first` (None: the stream ended before any chunk, as a text-only answer with no text does), then `rest`."""
    if first is not None:
        yield first
    async for sent in rest:
        yield sent


async def _http_body(
    first: SentChunk, rest: AsyncIterator[SentChunk], header: bytes, lease: AsyncExitStack
) -> AsyncIterator[bytes]:
    """The response body; `lease` (the cluster stream, the key's stream slot) is released when it
    ends, fails or is abandoned. The raw audio body carries no text (speech in: `stream_format: sse`)."""
    try:
        async for sent in _chunks(first, rest):
            if sent.audio is not None:
                yield header + sent.audio.pcm16
                header = b""
    finally:
        await lease.aclose()


async def _sse_body(
    job: Job, first: SentChunk, rest: AsyncIterator[SentChunk], header: bytes, lease: AsyncExitStack
) -> AsyncIterator[bytes]:
    """OpenAI's `stream_format: "sse"` body: a `speech.audio.delta` event per chunk (speech in: a
    `speech.text.delta` per piece of the answer's text), then `speech.audio.done`; a failure once the
    200 went out ends it with an `error` event."""
    num_frames = 0
    try:
        async for sent in _chunks(first, rest):
            if sent.audio is None:
                yield text_delta(sent.text)
                continue
            num_frames += sent.audio.num_frames
            yield audio_delta(header + sent.audio.pcm16)
            header = b""
        yield audio_done(len(job.text), num_frames)
    except Exception as err:
        failure, own = _failure(err)
        log_failure(failure, job.req_id, "HTTP", own)
        yield error_event(with_request_id(failure.message, job.req_id), failure.code.name.lower())
    finally:
        await lease.aclose()


async def _read_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused past `max_bytes` without reading the rest."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type != "application/json":
        got = printable_name(content_type) if content_type else "nothing"
        raise InvalidArgumentError("content-type", f"expected application/json, got {got}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise InvalidArgumentError("body", f"larger than {max_bytes} bytes")
    return bytes(body)


def _failure(err: Exception) -> tuple[Failure, Exception | None]:
    """The reply for `err`, and the exception whose traceback to log (a failure of our own code)."""
    code = grpc.StatusCode
    match err:
        case InvalidArgumentError(field=field):
            return Failure(code.INVALID_ARGUMENT, str(err), field), None
        case Unauthenticated():
            return Failure(code.UNAUTHENTICATED, str(err), "authorization"), None
        case AdmissionRejected(retry_after_s=retry_after_s) | QuotaExceeded(retry_after_s=retry_after_s):
            return Failure(code.RESOURCE_EXHAUSTED, str(err), None, retry_after_s), None
        case ReplicasUnavailable(retry_after_s=retry_after_s) | Draining(retry_after_s=retry_after_s):
            return Failure(code.UNAVAILABLE, str(err), None, retry_after_s), None
        case DeadlineUnmeetable():
            return Failure(code.DEADLINE_EXCEEDED, str(err)), None
        case StreamFailed() if (retry_after_s := out_of_memory_retry_s(str(err))) is not None:
            return Failure(code.RESOURCE_EXHAUSTED, str(err), None, retry_after_s), None  # our own words
        case StreamFailed():
            return Failure(code.INTERNAL, "synthesis failed", cause=str(err)[:500]), None
        case RayError():  # a stage replica died or raised: it logged its own traceback
            return Failure(code.INTERNAL, "synthesis failed", cause=type(err).__name__), None
    return Failure(code.INTERNAL, "internal error"), err


def _authorization(grpc_context) -> str | None:
    """The gRPC `authorization` metadata value (at most one)."""
    values = [v for k, v in grpc_context.invocation_metadata() if k == "authorization"] if grpc_context else []
    if len(values) > 1:
        raise Unauthenticated("authorization: given more than once")
    return values[0] if values else None


def _http_authorization(request: Request) -> str | None:
    values = request.headers.getlist("authorization")
    if len(values) > 1:
        raise Unauthenticated("authorization: given more than once")
    return values[0] if values else None


def retry_status(code: grpc.StatusCode, details: str, retry_after_s: float) -> bytes:
    """A serialized `google.rpc.Status` with a `RetryInfo` detail: the retry hint a gRPC client
    reads with `grpc_status.rpc_status.from_call` (the standard place, not only our trailers)."""
    delay = Duration(seconds=int(retry_after_s), nanos=round((retry_after_s % 1) * 1e9))
    detail = any_pb2.Any()
    detail.Pack(RetryInfo(retry_delay=delay))
    return Status(code=code.value[0], message=details, details=[detail]).SerializeToString()


def _abort(
    grpc_context, code: grpc.StatusCode, details: str, retry_after_s: float | None = None, req_id: str = ""
) -> None:
    """End the call with `code`, `details` and trailers (set on the call's context; the server ends it)."""
    if grpc_context is not None:
        trailers: list[tuple[str, str | bytes]] = [("x-request-id", req_id)] if req_id else []
        if retry_after_s is not None:
            trailers += [
                ("retry-after-s", f"{retry_after_s:.1f}"),
                ("retry-after-ms", str(round(retry_after_s * 1000))),
                ("grpc-status-details-bin", retry_status(code, details, retry_after_s)),
            ]
        grpc_context.set_trailing_metadata(tuple(trailers))
        grpc_context.set_code(code)
        grpc_context.set_details(details)
    raise GrpcAbort(f"{code.name}: {details}")


def _grpc_fail(grpc_context, err: Exception, req_id: str) -> None:
    failure, own = _failure(err)
    log_failure(failure, req_id, "gRPC", own)
    message = with_request_id(failure.message, req_id)
    _abort(grpc_context, failure.code, message, failure.retry_after_s, req_id)


def _http_fail(err: Exception, req_id: str) -> Response:
    failure, own = _failure(err)
    log_failure(failure, req_id, "HTTP", own)
    return http_error(failure, req_id, echo_id=req_id != _serve_request_id())


def _serve_request_id() -> str:
    """Serve's id for this HTTP request: the client's X-Request-Id, else one Serve made and returns
    in its own X-Request-Id response header (so ours is added only when it differs)."""
    context = serve.context._serve_request_context.get()
    return (context.request_id or "") if context is not None else ""


# Defined last: serve.ingress freezes the FastAPI app (and these methods) at class creation,
# so every helper they use must already exist; no postponed annotations in this module.
@serve.ingress(http_app)
class Router:
    """Serve ingress class (FastAPI routes + gRPC methods); deployed by `deployments.app`."""

    async def __init__(self, config: dict, llm_handles: dict, detok_handles: dict) -> None:  # ready = gRPC up
        """`llm_handles` / `detok_handles`: served model name -> its LLMStage / DetokStage deployment
        (models sharing a detokenizer share one handle's deployment)."""
        keep_replica_listener_on_loopback()
        self.config = ServeConfig.model_validate(config)
        self.models = ServedModels.build(self.config, llm_handles, detok_handles, replica_name())
        # zero-shot voices: each VoiceBank is a DetokStage's deployment actor; a detok replica names it
        cores = self.models.cores
        self.voices = {name: self._voice_registry(core, detok_handles[name]) for name, core in cores.items()}
        for name, core in cores.items():
            core.use_voices(self.voices[name])
        self.models.start()  # rebalancers on this replica's event loop, like the admission checks
        self.auth = ApiKeys(self.config.auth, listen_host=widest_host(self.config))
        if self.config.http_docs:
            expose_docs(http_app)
        self.grpc = SpeechServer(self.config, self)
        await self.grpc.start()  # on the replica's event loop, where the gRPC methods run

    @staticmethod
    def _voice_registry(core, detok_handle) -> VoiceRegistry:
        find_bank = detok_handle.voice_bank.remote if core.entry.family.lm.takes_registered_voices else None
        return VoiceRegistry(core.entry, core.config.voices, find_bank)

    @property
    def core(self):
        """The default model's core (the only one of a single-model app)."""
        return self.models.default

    async def __del__(self) -> None:  # Serve calls it when the replica shuts down
        await self.models.stop()
        await self.grpc.stop()

    # ---- gRPC -----------------------------------------------------------------------------
    async def Synthesize(self, request: voxray_pb2.SynthesizeRequest | bytes, grpc_context=None):  # noqa: N802
        req_id = reply_request_id("")
        try:
            key = self.auth.check(_authorization(grpc_context))
            fields = fields_from_proto(request)
            req_id = reply_request_id(fields["req_id"])
            core = self.models.core_for(fields["model"])
            job = core.job(**{**fields, "req_id": fields["req_id"] or req_id})
            job = await core.fit_client_deadline(job, grpc_context)
            header = streaming_wav_header(core.entry.sample_rate_hz) if job.output_format == "wav" else b""
            with self.auth.hold_stream(key):
                async with aclosing(core.run(job)) as stream:  # closed on any failure: the replica frees it
                    async for chunk in _grpc_chunks(job, stream, header):
                        yield chunk
        except Exception as err:  # every failure gets a status, a short message and one log line
            _grpc_fail(grpc_context, err, req_id)

    async def SynthesizeStream(self, requests: AsyncIterator[bytes], grpc_context=None):  # noqa: N802
        """Incremental text in, audio out (`router.grpc_stream`): the same session as the WebSocket."""
        req_id = reply_request_id("")
        try:
            key = self.auth.check(_authorization(grpc_context))
            fields, first_piece = await read_config(requests)
            core = self.models.core_for(fields["model"])
            job = core.job(**{**fields, "req_id": fields["req_id"] or req_id})
            req_id = job.req_id
            header = streaming_wav_header(core.entry.sample_rate_hz) if job.output_format == "wav" else b""
            with self.auth.hold_stream(key):
                async with core.incremental(job) as session:
                    if first_piece:
                        session.push(first_piece, field="config.text")
                    async with aclosing(stream_audio(requests, session, job.req_id, header)) as chunks:
                        async for chunk in chunks:
                            yield chunk
        except Exception as err:
            _grpc_fail(grpc_context, err, req_id)

    async def Converse(self, requests: AsyncIterator[bytes], grpc_context=None):  # noqa: N802
        """Streamed microphone audio in, the answer's text and audio out (`router.grpc_converse`)."""
        req_id = reply_request_id("")
        try:
            key = self.auth.check(_authorization(grpc_context))
            fields, rate, first_piece = await read_converse_config(requests)
            req_id = reply_request_id(fields["req_id"])  # (`read_converse_config` checked the client's)
            fields["req_id"] = fields["req_id"] or req_id
            core = self.models.core_for(fields["model"])
            with self.auth.hold_stream(key):
                turn = open_turn(core.entry, core.config.speech_in, rate, first_piece, core.mic_forward(rate))
                reading = read_turn(requests, turn, core.config.incremental.idle_timeout_s)
                job = await core.fit_client_deadline(await turn_job(core.job, fields, turn, reading), grpc_context)
                header = streaming_wav_header(core.entry.sample_rate_hz) if job.output_format == "wav" else b""
                async with aclosing(core.run(job)) as stream:
                    async for chunk in _grpc_chunks(job, stream, header):
                        yield chunk
        except IdleTimeout as err:
            _abort(grpc_context, grpc.StatusCode.DEADLINE_EXCEEDED, with_request_id(str(err), req_id), req_id=req_id)
        except Exception as err:
            _grpc_fail(grpc_context, err, req_id)

    async def Transcribe(self, request: voxray_pb2.TranscribeRequest | bytes, grpc_context=None):  # noqa: N802
        """A clip's transcript (`router.grpc_transcribe`): the HTTP transcription's text-only job."""
        req_id = reply_request_id("")
        try:
            key = self.auth.check(_authorization(grpc_context))
            transcription = transcription_from_proto(request)
            req_id = reply_request_id(transcription.request_id)
            core = self.models.core_for(transcription.model)
            job = transcription_job(transcription, core.entry, core.job, req_id)
            job = await core.fit_client_deadline(job, grpc_context)
            with self.auth.hold_stream(key):
                text = await transcribe(core.run(job))
        except Exception as err:
            _grpc_fail(grpc_context, err, req_id)
        return transcribe_response(transcription, job, text)

    async def ListModels(self, request: voxray_pb2.ListModelsRequest | bytes, grpc_context=None):  # noqa: N802
        try:
            self.auth.check(_authorization(grpc_context))
            parse_proto(voxray_pb2.ListModelsRequest, request)
        except Exception as err:
            _grpc_fail(grpc_context, err, reply_request_id(""))
        return models_response(self.models.entries())

    async def ListVoices(self, request: voxray_pb2.ListVoicesRequest | bytes, grpc_context=None):  # noqa: N802
        try:
            self.auth.check(_authorization(grpc_context))
            request = parse_proto(voxray_pb2.ListVoicesRequest, request)
            entry = self.models.core_for(request.model).entry
        except Exception as err:
            _grpc_fail(grpc_context, err, reply_request_id(""))
        return voices_response(entry)

    async def RegisterVoice(self, request: voxray_pb2.RegisterVoiceRequest | bytes, grpc_context=None):  # noqa: N802
        try:
            self.auth.check(_authorization(grpc_context))
            fields = voice_request_from_proto(request)
            registered = await self.voices[self.models.voices_core(fields["model"]).entry.name].register(**fields)
        except Exception as err:
            _grpc_fail(grpc_context, err, reply_request_id(""))
        return voxray_pb2.RegisterVoiceResponse(
            voice_id=registered["voice_id"], prompt_tokens=registered["prompt_tokens"],
            duration_s=registered["duration_s"], created=registered["created"],
        )  # fmt: skip

    # ---- HTTP -----------------------------------------------------------------------------
    @http_app.post("/v1/voices")
    async def register_voice(self, request: Request) -> Response:
        """Register a zero-shot voice from a reference clip (`router.voices` documents the body)."""
        req_id = reply_request_id(_serve_request_id())
        try:
            self.auth.check(_http_authorization(request))
            fields = voice_request_from_json(await _read_body(request, MAX_HTTP_BODY_BYTES))
            registered = await self.voices[self.models.voices_core(fields["model"]).entry.name].register(**fields)
        except Exception as err:
            return _http_fail(err, req_id)
        return JSONResponse({"object": "voice", "id": registered.pop("voice_id"), **registered})

    @http_app.get("/v1/voices")
    async def list_voices(self, request: Request) -> Response:
        """The built-in voices and the registered ones (of `?model=`, else the default model)."""
        try:
            self.auth.check(_http_authorization(request))
            entry = self.models.core_for(request.query_params.get("model", "")).entry
            registered = await self.voices[entry.name].voice_ids()
        except Exception as err:
            return _http_fail(err, reply_request_id(_serve_request_id()))
        return JSONResponse({"object": "list", "default": entry.default_voice, "voices": list(entry.voices),
                             "registered": registered})  # fmt: skip

    @http_app.websocket("/v1/audio/speech/stream")
    async def speech_stream(self, websocket: WebSocket) -> None:
        """Incremental text in, audio out (`router.websocket` documents the messages)."""
        await self._stream_endpoint().serve(websocket, reply_request_id(""))

    @http_app.websocket("/v1/audio/converse")
    async def converse_stream(self, websocket: WebSocket) -> None:
        """Streamed microphone audio in, text and audio out (`router.mic_websocket` documents the messages)."""
        endpoint = MicEndpoint(self._ws_authorize, self.models.core_for, _failure)
        await endpoint.serve(websocket, reply_request_id(""))

    @asynccontextmanager
    async def _ws_authorize(self, websocket: WebSocket):
        values = websocket.headers.getlist("authorization")
        if len(values) > 1:
            raise Unauthenticated("authorization: given more than once")
        with self.auth.hold_stream(self.auth.check(values[0] if values else None)):
            yield

    def _stream_endpoint(self) -> StreamEndpoint:
        authorize = self._ws_authorize

        chosen = []  # the config's model's core, picked by `template` before the session opens

        def template(fields: dict) -> Job:
            chosen.append(self.models.core_for(fields["model"]))
            return chosen[-1].job(**{**fields, "req_id": fields["req_id"] or reply_request_id("")})

        return StreamEndpoint(authorize, template, lambda job: chosen[-1].incremental(job), None, _failure)

    @http_app.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok", "model": self.core.entry.name, "models": self.models.names}

    @http_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self.auth.check(_http_authorization(request))
        except Exception as err:
            return _http_fail(err, reply_request_id(_serve_request_id()))
        return JSONResponse(models_json(self.models.entries()))

    @http_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        """Speech in, OpenAI-style (`router.chat`): the answer's audio and transcript, whole or as SSE."""
        req_id = reply_request_id(_serve_request_id())
        lease = AsyncExitStack()
        try:
            key = self.auth.check(_http_authorization(request))
            body = await _read_body(request, MAX_BODY_BYTES + MAX_AUDIO_JSON_BYTES)
            fields, is_streamed = chat_request(body, request.headers.getlist("x-request-id"))
            core = self.models.core_for(fields.get("model", ""))
            job = core.job(**{**fields, "req_id": fields["req_id"] or req_id})
            lease.enter_context(self.auth.hold_stream(key))
            stream = await lease.enter_async_context(aclosing(core.run(job)))
            first = await anext(stream, None)  # admission and validation happen before any byte is sent
            reply, rate = ChatReply(job, core.entry.name), core.entry.sample_rate_hz
            if not is_streamed:
                async with lease:
                    return JSONResponse(await chat_whole(reply, _chunks(first, stream), rate))
            header = streaming_wav_header(rate) if job.output_format == "wav" else b""
            body_parts = chat_sse_body(reply, _chunks(first, stream), header, lease)
            return StreamingResponse(body_parts, media_type=SSE_MEDIA_TYPE, background=BackgroundTask(lease.aclose))
        except Exception as err:
            await lease.aclose()
            return _http_fail(err, req_id)
        except BaseException:
            await lease.aclose()
            raise

    @http_app.post("/v1/audio/transcriptions")
    async def transcriptions(self, request: Request) -> Response:
        """Understanding alone, OpenAI-style (`router.transcriptions`): an uploaded clip's transcript, from a
        text-only speech-in stream (no detokenizer work)."""
        req_id = reply_request_id(_serve_request_id())
        try:
            key = self.auth.check(_http_authorization(request))
            form = await read_transcription_form(request)
            core = self.models.core_for(form.model)
            job = transcription_job(form, core.entry, core.job, req_id)
            req_id = job.req_id
            with self.auth.hold_stream(key):
                text = await transcribe(core.run(job))
        except Exception as err:
            return _http_fail(err, req_id)
        headers = {"X-Request-Id": job.req_id} if job.req_id != _serve_request_id() else {}
        return transcription_response(form, job, text, headers)

    @http_app.post("/v1/audio/speech")
    async def speech(self, request: Request) -> Response:
        req_id = reply_request_id(_serve_request_id())
        lease = AsyncExitStack()  # what an admitted stream holds; released by the body, or here on failure
        try:
            key = self.auth.check(_http_authorization(request))
            body = await _read_body(request, MAX_BODY_BYTES + MAX_AUDIO_JSON_BYTES)  # speech in: base64 audio
            fields, stream_format = speech_request(body, request.headers.getlist("x-request-id"))
            req_id = reply_request_id(fields["req_id"] or req_id)
            core = self.models.core_for(fields["model"])
            job = core.job(**{**fields, "req_id": fields["req_id"] or req_id})
            lease.enter_context(self.auth.hold_stream(key))
            stream = await lease.enter_async_context(aclosing(core.run(job)))
            first = await anext(stream)  # admission and validation happen before any byte is sent
            media = "audio/wav" if job.output_format == "wav" else "audio/pcm"
            header = streaming_wav_header(core.entry.sample_rate_hz) if job.output_format == "wav" else b""
            if stream_format == "sse":
                media, body = SSE_MEDIA_TYPE, _sse_body(job, first, stream, header, lease)
            else:
                body = _http_body(first, stream, header, lease)
            headers = {"X-Request-Id": job.req_id} if job.req_id != _serve_request_id() else {}
            return StreamingResponse(body, media_type=media, headers=headers, background=BackgroundTask(lease.aclose))
        except Exception as err:
            await lease.aclose()
            return _http_fail(err, req_id)
        except BaseException:  # cancelled: the client left before the response started
            await lease.aclose()
            raise

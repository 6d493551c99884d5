"""The gRPC unary `Transcribe`: a TranscribeRequest read into the `Transcription` that HTTP's
`/v1/audio/transcriptions` reads from its upload, so both front ends share `router.transcriptions`'
checks, ASR instruction and text-only Job; the answer as a TranscribeResponse (the text, the language
asked as verbose_json names it, the clip's duration). HTTP's `file` is `audio` here: its errors name
`audio`, `audio.data`, `audio.format`, `audio.sample_rate_hz`. The Router's `Transcribe` method uses it.
"""

from __future__ import annotations

from core.errors import InvalidArgumentError
from core.messages import Job
from protos import voxray_pb2
from router.jobs import input_audio_from_proto, parse_with_audio
from router.transcriptions import Transcription, check_language, check_temperature, clip_duration_s, language_name

AUDIO_FIELD = "audio"


def transcription_from_proto(request: voxray_pb2.TranscribeRequest | bytes) -> Transcription:
    """The request's checked fields (or INVALID_ARGUMENT naming the field)."""
    message = parse_with_audio(voxray_pb2.TranscribeRequest, request, AUDIO_FIELD)
    if not message.HasField(AUDIO_FIELD):
        raise InvalidArgumentError(AUDIO_FIELD, "is required: the clip to transcribe (WAV, or PCM16 at its rate)")
    return Transcription(
        audio=input_audio_from_proto(message.audio, AUDIO_FIELD), model=message.model, prompt=message.prompt,
        language=check_language(message.language), temperature=check_temperature(message.temperature),
        request_id=message.request_id,
    )  # fmt: skip


def transcribe_response(request: Transcription, job: Job, text: str) -> voxray_pb2.TranscribeResponse:
    return voxray_pb2.TranscribeResponse(
        text=text, language=language_name(request.language), duration_s=clip_duration_s(job), request_id=job.req_id
    )

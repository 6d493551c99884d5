"""Registering a zero-shot voice (`POST /v1/voices`, gRPC `RegisterVoice`): the request checked and
its clip decoded here, then encoded once by the app's VoiceBank actor, which answers with the id.

HTTP takes JSON: `{"audio": "<base64 of a WAV file>", "prompt_text": "<its transcript>", "model": ""}`
(prompt_text and model optional); gRPC the same fields in `RegisterVoiceRequest` (audio as bytes).
Every rejection names the field: `audio` (not base64, not a PCM WAV, unsupported rate, too short or
long, empty, silent), `prompt_text`, `model`, `body`.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from ray.exceptions import RayActorError

from core.config import VoicesConfig
from core.errors import InvalidArgumentError
from core.voices import is_voice_id
from detok_stage.voice.clip import decode_clip
from llm_stage.jobs import printable_name
from llm_stage.registry import ModelEntry, families
from protos import voxray_pb2
from router.jobs import parse_json_object

MAX_CLIP_BYTES = 6 * 1024 * 1024  # a 20 s 48 kHz stereo 32-bit WAV is 7.7 MB: clips are expected mono 16-bit
MAX_HTTP_BODY_BYTES = MAX_CLIP_BYTES * 4 // 3 + 64 * 1024  # base64 plus the other fields
HTTP_FIELDS = frozenset({"audio", "prompt_text", "model"})
# an id the VoiceBank did not know is not asked about again for this long: a client retrying a mistyped id does not
# cost a bank call each time, and a voice registered through another Router meanwhile counts soon after
UNKNOWN_RECHECK_S = 10.0


def voice_request_from_json(body: bytes) -> dict:
    obj = parse_json_object(body, MAX_HTTP_BODY_BYTES)
    unknown = set(obj) - HTTP_FIELDS
    if unknown:
        raise InvalidArgumentError(printable_name(sorted(unknown)[0]), "unknown field")
    audio = obj.get("audio")
    if not isinstance(audio, str):
        raise InvalidArgumentError("audio", "must be a string: the base64 of a WAV file")
    try:
        clip = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError("audio", "is not valid base64") from None
    return {"audio": clip, "prompt_text": _string(obj, "prompt_text"), "model": _string(obj, "model")}


def voice_request_from_proto(request: voxray_pb2.RegisterVoiceRequest | bytes) -> dict:
    if isinstance(request, (bytes, bytearray)):
        try:
            request = voxray_pb2.RegisterVoiceRequest.FromString(bytes(request))
        except DecodeError:
            raise InvalidArgumentError("request", "is not a valid voxray.RegisterVoiceRequest") from None
    unknown = UnknownFieldSet(request)
    if len(unknown):
        raise InvalidArgumentError("request", f"unknown field number {unknown[0].field_number}")
    return {"audio": bytes(request.audio), "prompt_text": request.prompt_text, "model": request.model}


def _string(obj: dict, name: str) -> str:
    value = obj.get(name, "")
    if not isinstance(value, str):
        raise InvalidArgumentError(name, "must be a string")
    return value


def check_prompt_text(text: str, config: VoicesConfig) -> str:
    if len(text) > config.max_prompt_text_chars:
        raise InvalidArgumentError("prompt_text", f"is {len(text)} characters; at most {config.max_prompt_text_chars}")
    if any(not ch.isprintable() and ch not in " \n\t" for ch in text):
        raise InvalidArgumentError("prompt_text", "holds control characters")
    return " ".join(text.split())


def check_model(entry: ModelEntry, model: str) -> None:
    if model and model != entry.name:
        raise InvalidArgumentError(
            "model", f"unknown model {printable_name(model)!r}; this server serves {entry.name!r}"
        )
    if not entry.family.lm.takes_registered_voices:
        takers = ", ".join(family.name for family in families() if family.lm.takes_registered_voices)
        raise InvalidArgumentError("model", f"{entry.name} does not take zero-shot voices ({takers} do)")


class VoiceRegistry:
    """The Router's side: checks a registration and hands the decoded clip to the VoiceBank; and what each
    registered voice this Router has seen adds to a request's prompt (`prompt_positions`, for the Router's own
    admission estimate and ranking: `router.streams.RouterCore.prompt_work`)."""

    def __init__(self, entry: ModelEntry, config: VoicesConfig, bank_factory: Callable[[], Awaitable] | None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.entry, self.config, self.bank_factory, self.clock = entry, config, bank_factory, clock
        self.bank = None
        self.positions: dict[str, int] = {}  # registered voice id -> prompt positions it adds (looked up once)
        self.unknown: dict[str, float] = {}  # id -> when the bank last did not know it (`UNKNOWN_RECHECK_S`)

    def prompt_positions(self, voice: str | None) -> int:
        """What `voice` adds to a request's prompt as far as this Router knows (0: none, or not looked up yet)."""
        return self.positions.get(voice, 0) if voice else 0

    async def learn(self, voice: str | None) -> None:
        """Look a registered voice's prompt up once (`LMAdapter.registered_voice_positions`); an unknown id, a family
        with no voice prompt or a lost bank leave it at 0 (the replica, which looks every voice up, refuses an unknown
        one naming `voice`). An unknown id is asked about again after UNKNOWN_RECHECK_S. A family whose voices are
        alike (`LMAdapter.voices_alike`) is not asked: the Router counts its replicas' default voice instead."""
        lm = self.entry.family.lm
        if self.bank_factory is None or not lm.takes_registered_voices or lm.voices_alike or not is_voice_id(voice):
            return
        if voice in self.positions or len(self.positions) >= self.config.max_voices:
            return
        now = self.clock()
        if now - self.unknown.get(voice, -UNKNOWN_RECHECK_S) < UNKNOWN_RECHECK_S:
            return
        try:
            self.bank = self.bank or await self.bank_factory()
            prompt = await self.bank.prompt.remote(voice)
        except RayActorError:  # the bank died: Serve recreates it (without its voices)
            self.bank = None
            return
        if prompt is None:
            self._remember_unknown(voice, now)
            return
        self.unknown.pop(voice, None)
        self.positions[voice] = lm.registered_voice_positions(prompt)

    def _remember_unknown(self, voice: str, now: float) -> None:
        self.unknown.pop(voice, None)  # re-inserted last: the oldest go first when the table is full
        if len(self.unknown) >= self.config.max_voices:
            self.unknown.pop(next(iter(self.unknown)))
        self.unknown[voice] = now

    async def register(self, audio: bytes, prompt_text: str, model: str) -> dict:
        """{"voice_id", "prompt_tokens", "duration_s", "created"} for a registration's fields."""
        check_model(self.entry, model)
        if self.bank_factory is None:
            raise InvalidArgumentError("model", "this server has no voice bank")
        text = check_prompt_text(prompt_text, self.config)
        if len(audio) > MAX_CLIP_BYTES:
            raise InvalidArgumentError("audio", f"is {len(audio)} bytes; at most {MAX_CLIP_BYTES}")
        clip = decode_clip(audio, "audio", self.config.min_clip_s, self.config.max_clip_s)
        self.bank = self.bank or await self.bank_factory()
        try:
            result = await self.bank.register.remote(clip.wave, clip.sample_rate_hz, text)
        except RayActorError:  # the bank died: Serve recreates it; ask a detok replica for the new one
            self.bank = await self.bank_factory()
            result = await self.bank.register.remote(clip.wave, clip.sample_rate_hz, text)
        if hasattr(result, "error"):  # Refused
            raise result.error()
        self.unknown.pop(result.voice_id, None)  # asked about before it was registered: known now
        await self.learn(result.voice_id)  # its prompt counts in this Router's estimates from now on
        return {"voice_id": result.voice_id, "prompt_tokens": result.num_prompt_tokens,
                "duration_s": round(result.duration_s, 3), "created": result.is_new}  # fmt: skip

    async def voice_ids(self) -> list[str]:
        if self.bank_factory is None or not self.entry.family.lm.takes_registered_voices:
            return []
        self.bank = self.bank or await self.bank_factory()
        try:
            return await self.bank.voice_ids.remote()
        except RayActorError:  # the bank died: its voices with it
            self.bank = None
            return []

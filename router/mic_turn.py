"""One microphone turn (streamed speech in): the stated encoding and rate checked once, then PCM16
pieces checked and handed to the model's front end as they arrive (resampled and turned into the
encoder's features there: `LMAdapter.audio_front_end`), and at the end of the turn the whole clip
with its features, ready for a Job. A family whose speech tokenizer needs the model's weights
(GLM-4-Voice: `LMAdapter.tokenizes_mic_audio`) has the pieces forwarded to an LLM replica that
tokenizes them as they come (`router.mic_tokens`); its Job carries the tokens beside the clip (the
whole clip alone if the forwarding failed, tokenized where the Job runs). Shared by the gRPC
`Converse` (`router.grpc_converse`) and the WebSocket (`router.mic_websocket`); every refusal is an
InvalidArgumentError naming the client's field.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from core.config import SpeechInConfig
from core.errors import InvalidArgumentError
from core.messages import AudioFeatures, Job
from detok_stage.voice.clip import SILENCE_PEAK, SUPPORTED_RATES_HZ
from llm_stage.models.base import AudioFrontEnd
from llm_stage.registry import ModelEntry
from router.audio_input import InputAudio
from router.mic_tokens import ReplicaMicTokens

WAV_MAGIC = b"RIFF"
RATES = ", ".join(str(r) for r in SUPPORTED_RATES_HZ)


@dataclass(frozen=True)
class MicFields:
    """How the client names the turn's fields (gRPC and the WebSocket spell them differently)."""

    model: str = "model"
    encoding: str = "input_audio.format"
    rate: str = "input_audio.sample_rate_hz"
    audio: str = "audio"


def check_rate(sample_rate_hz: object, field: str) -> int:
    if isinstance(sample_rate_hz, bool) or not isinstance(sample_rate_hz, int):
        raise InvalidArgumentError(field, "must be an integer number of Hz")
    if sample_rate_hz not in SUPPORTED_RATES_HZ:
        raise InvalidArgumentError(field, f"is {sample_rate_hz} Hz; PCM16 microphone audio needs one of {RATES}")
    return sample_rate_hz


class MicTurn:
    """The user's audio of one turn, fed to `entry`'s front end piece by piece."""

    def __init__(
        self, entry: ModelEntry, config: SpeechInConfig, sample_rate_hz: int, fields: MicFields,
        forward: ReplicaMicTokens | None = None,
    ) -> None:  # fmt: skip
        """`forward`: the pieces' forwarding to a replica that tokenizes them (`RouterCore.mic_forward`)."""
        if not entry.family.lm.takes_audio:
            raise InvalidArgumentError(fields.model, f"{entry.name} takes no audio (it speaks text)")
        self.forward = forward
        # None: the clip is encoded whole by the LLM replica at the end of the turn
        self.front_end: AudioFrontEnd | None = entry.family.lm.audio_front_end(sample_rate_hz)
        self.config, self.sample_rate_hz, self.fields = config, sample_rate_hz, fields
        self.max_bytes = 2 * int(config.max_audio_s * sample_rate_hz)
        self.pcm16 = bytearray()
        self.peak = 0.0

    @property
    def duration_s(self) -> float:
        return len(self.pcm16) / 2 / self.sample_rate_hz

    def push(self, piece: bytes) -> None:
        """One piece of PCM16 (little-endian mono): checked, kept, and run through the front end now."""
        field = self.fields.audio
        if not piece:
            raise InvalidArgumentError(field, "is empty")
        if piece.startswith(WAV_MAGIC) and not self.pcm16:
            raise InvalidArgumentError(field, f"is a WAV file; send raw PCM16 at {self.sample_rate_hz} Hz")
        if len(piece) % 2:
            raise InvalidArgumentError(field, f"has {len(piece)} bytes; PCM16 samples are 2 bytes each")
        if len(self.pcm16) + len(piece) > self.max_bytes:
            seconds = (len(self.pcm16) + len(piece)) / 2 / self.sample_rate_hz
            raise InvalidArgumentError(field, f"the turn reached {seconds:.2f} s; at most "
                                       f"{self.config.max_audio_s:g} s are accepted")  # fmt: skip
        self.pcm16 += piece
        samples = np.frombuffer(piece, dtype="<i2")
        self.peak = max(self.peak, float(np.abs(samples.astype(np.int32)).max()) / 32768.0)
        if self.front_end is not None:
            self.front_end.push_pcm16(piece)
        if self.forward is not None:
            self.forward.push(piece)

    def finish(self) -> tuple[InputAudio, AudioFeatures | None]:
        """The whole clip (checked again by the Job's validation) and its features, computed as it came
        (None: the family has no Router-side front end)."""
        field = self.fields.audio
        if not self.pcm16:
            raise InvalidArgumentError(field, "the turn ended before any audio came")
        if self.duration_s < self.config.min_audio_s:
            raise InvalidArgumentError(
                field, f"the turn is {self.duration_s:.2f} s long; at least {self.config.min_audio_s:g} s is needed"
            )
        if self.peak < SILENCE_PEAK:
            raise InvalidArgumentError(field, "the turn is silent")
        clip = InputAudio(bytes(self.pcm16), "pcm16", self.sample_rate_hz, field=field)
        return clip, self.front_end.finish() if self.front_end is not None else None


    async def abandon(self) -> None:
        """The turn ends without a Job (a refusal, the client gone): a replica tokenizing it drops it."""
        if self.forward is not None:
            await self.forward.cancel()


async def turn_job(make_job: Callable[..., Job], fields: dict, turn: MicTurn, reading: Awaitable[None]) -> Job:
    """The turn's Job once `reading` (the endpoint's loop feeding `turn`) ends: the config's fields with the
    whole clip (validated as any clip is), the features its front end computed as the audio came (so the
    LLM replica only encodes), or the speech tokens a replica computed as it came. A turn that fails
    (a refusal, an idle client, one that left) is abandoned."""
    try:
        await reading
        clip, features = turn.finish()
        job = make_job(**{**fields, "input_audio": clip})
    except BaseException:
        await asyncio.shield(turn.abandon())
        raise
    tokens = await turn.forward.tokens() if turn.forward is not None else None
    return dataclasses.replace(job, audio_features=features, audio_tokens=tokens)

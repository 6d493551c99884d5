"""Typed messages between the stages: the validated `Job` with its one `SamplingParams`, the
stream events an LLM replica sends the router, `TokenChunk` and `AudioChunk`.

The ingress validates a request once into a Job (`llm_stage.jobs.build_job`); the LLM stage
answers with one head event (Admitted / Queued / Rejected / Invalid) and then Audio events
(or a Failed one). The LLM stage produces TokenChunks, the detokenizer turns them into
AudioChunks. Chunks are self-describing: they carry their left/right context frames so a cold
detokenizer produces the same audio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from core.errors import InvalidArgumentError, from_validation_error

if TYPE_CHECKING:
    import numpy as np
    import torch


class SamplingParams(BaseModel):
    """Per-request sampling; validated so a bad value names its field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.6, ge=0.0, le=10.0, description="0 = greedy.")
    top_k: int = Field(0, ge=0, le=1_000_000, description="0 = off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    repetition_window: int = Field(0, ge=0, description="Last N tokens penalised; 0 = whole sequence.")
    max_tokens: int = Field(1200, ge=1, le=100_000)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    guidance_scale: float | None = Field(
        None, ge=0.0, le=100.0, description="Classifier-free guidance scale (model's own formula); None = off."
    )
    ras_window: int = Field(
        0, ge=0, le=1000,
        description="Repetition-aware sampling (CosyVoice 2): the last N generated tokens each draw is checked "
        "against; 0 = off. The draw is a nucleus draw (top-k, and top-p over the whole distribution, as "
        "CosyVoice's); one repeated at least ras_tau * ras_window times in the window is redrawn from the whole "
        "distribution without it. Greedy rows (temperature 0) are not redrawn.",
    )  # fmt: skip
    ras_tau: float = Field(0.1, gt=0.0, le=1.0, description="RAS: repeat ratio of the window that triggers a redraw.")
    exaggeration: float | None = Field(
        None, ge=0.0, le=2.0,
        description="Emotion exaggeration of the voice conditioning (Chatterbox); None = the model's default.",
    )  # fmt: skip

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def is_repetition_aware(self) -> bool:
        """Drawn by RAS (`llm_stage.ras`): a window is set and the row is not greedy by temperature."""
        return self.ras_window > 0 and self.temperature > 0.0

    @classmethod
    def resolve(cls, overrides: SamplingParams | dict | None, default: SamplingParams) -> SamplingParams:
        """The client's fields merged over the model's default; a bad value raises naming `sampling.<field>`."""
        if isinstance(overrides, SamplingParams):
            return overrides
        if overrides is not None and not isinstance(overrides, dict):
            raise InvalidArgumentError("sampling", "must be an object of sampling fields")
        try:
            return default if not overrides else cls(**{**default.model_dump(), **overrides})
        except pydantic.ValidationError as err:
            raise from_validation_error(err, "sampling") from None
        except TypeError as err:
            raise InvalidArgumentError("sampling", str(err)) from None


OutputFormat = Literal["pcm16", "wav"]


# One engine position: a vocab id, or one id per codebook (multi-codebook families).
SampledToken = int | tuple[int, ...]


@dataclass(frozen=True)
class Checkpoint:
    """A stream's sampler state when its LLM replica cut a chunk, as a delta: the tokens sampled
    since the stream's previous checkpoint (draws are keyed by the job's seed and the tokens drawn,
    `llm_stage.draws`, so the tokens are the whole state). The router adds them up (`ResumeState`)
    so another replica can continue the stream."""

    first_index: int  # index of new_tokens[0] among the stream's sampled tokens
    new_tokens: tuple[SampledToken, ...]


@dataclass(frozen=True)
class KVParcel:
    """A moved stream's KV rows, handed from the replica that ran it to the one that continues it:
    `ref` (a ray.ObjectRef of the rows as named tensors, owned by the sender) on node `node_id`,
    sent over the stage transport under `key` when the receiver asks (or read from the object store)."""

    ref: object
    key: str
    node_id: str
    num_bytes: int


@dataclass(frozen=True)
class ResumeState:
    """Where a stream stood when its LLM replica was lost: the replica that resumes it prefills
    the prompt plus `tokens`, draws on from there, and continues its chunks at `next_seq`
    (frames before `frames_shipped` already reached the client). Greedy and seeded streams then
    emit the tokens an uninterrupted run emits (CFG twins follow the same tokens)."""

    tokens: tuple[SampledToken, ...]
    next_seq: int
    frames_shipped: int
    kv: KVParcel | None = None  # a moved stream's KV rows; None = prefill
    detok_replica: str = ""  # where a stateful detokenizer keeps its decoder state ("": unknown / stateless)
    # a streamed-text stream's later text, as the Router sent it (the first piece is `Job.text`):
    # replayed in order into the new request's feed, so its positions read the same text ids
    text_pieces: tuple[TextPiece, ...] = ()


@dataclass(frozen=True)
class ContextTurn:
    """An earlier segment of an incremental stream, for families that condition on previous turns
    (CSM): its text, voice and the codec frames generated for it (K codes each)."""

    text: str
    voice: str | None
    frames: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class AudioFeatures:
    """The front end's output for a speech-in clip, computed where its audio arrived (streamed microphone
    input: piece by piece in the Router, so the LM replica only encodes): one float32 array
    [n_mels, frames] per encoder piece. `front_end` names what made them; an adapter with another front
    end ignores them and computes its own from `Job.audio`."""

    front_end: str
    mels: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class AudioClip:
    """Audio a request carries to the LM (speech in): mono PCM16 little-endian at `sample_rate_hz`,
    checked at the ingress (format, rate, duration); the LLM replica resamples and encodes it."""

    pcm16: bytes
    sample_rate_hz: int

    @property
    def num_samples(self) -> int:
        return len(self.pcm16) // 2

    @property
    def duration_s(self) -> float:
        return self.num_samples / self.sample_rate_hz


@dataclass(frozen=True)
class TextDelta:
    """The answer's text a speech-in request's LM decoded since the last delta (it may lead the audio);
    `is_final` ends the request's text. `decoded_s` is the engine's monotonic clock when it was cut."""

    req_id: str
    text: str
    is_final: bool = False
    decoded_s: float = 0.0
    # the tokens sampled since the stream's previous checkpoint, as of the step that decoded it (None: none
    # new): the Router adds them up with the chunks' (`ResumeState`), so a resumed stream says no text twice
    checkpoint: Checkpoint | None = None


@dataclass(frozen=True)
class ChatTurn:
    """An earlier turn of a speech-in conversation (`Job.history`), checked at the ingress: the user's
    text and clip, or the assistant's answer as text (its transcript when it was spoken)."""

    role: Literal["user", "assistant"]
    text: str
    audio: AudioClip | None = None  # user turns only


@dataclass(frozen=True)
class Job:
    """One validated synthesis request: built once at the ingress, handed to the engine unchanged."""

    req_id: str
    text: str
    voice: str | None
    sampling: SamplingParams  # the model's defaults with the client's fields applied
    ttfa_deadline_s: float
    output_format: OutputFormat = "pcm16"
    text_field: str = "text"  # the text field as the client spelled it ("input" over HTTP)
    resume: ResumeState | None = None  # set by the router when it moves the stream to another replica
    segment_index: int = 0  # an incremental stream's segment; > 0: admitted with its stream's first segment
    context: tuple[ContextTurn, ...] = ()  # earlier segments, for families with `LMAdapter.uses_context_turns`
    # A later segment of a playing stream: the audio its client has not played yet when the segment
    # is sent, so the engine schedules it by its stream's playback deadline, not as a new startup.
    buffered_audio_s: float | None = None
    # Native text streaming (`ModelFamily.streams_text`): `text` is the first piece; later pieces reach
    # the running request (`LLMEngine.push_text`), which waits for them holding its KV.
    text_streaming: bool = False
    # Speech in (families with `ModelFamily.takes_audio`): the user's audio; `text` is then optional
    # text beside it (an instruction), and the answer streams text beside its audio
    audio: AudioClip | None = None
    # Speech in, a text-only answer (`LMAdapter.answers_text_only`): the LM never starts speech, no chunk
    # goes to a detokenizer, and the stream ends with its final TextDelta
    text_only: bool = False
    # Speech in: the system turn of the family's prompt ("" = the family's default), e.g. the
    # transcription instruction `router.transcriptions` puts there
    system: str = ""
    # Streamed microphone input: `audio`'s front-end features, computed as it arrived (`AudioFeatures`)
    audio_features: AudioFeatures | None = None
    # Streamed microphone input of a family whose LLM replica tokenizes audio (`LMAdapter.mic_tokenizer`):
    # `audio`'s speech tokens, tokenized there as the audio arrived (`MicPiece`); None: tokenized at add
    audio_tokens: tuple[int, ...] | None = None
    # Speech in, multi-turn chat (`LMAdapter.takes_chat_history`): the conversation's earlier turns, oldest
    # first; `text` / `audio` are its last user turn. The adapter renders them in the family's prompt format
    history: tuple[ChatTurn, ...] = ()


@dataclass(frozen=True)
class TextPiece:
    """More text for a running streaming-text job (`Job.text_streaming`), sent by the Router to the LLM
    replica serving it (`llm_replica`, the tag its head event named: the request router pins it there).
    `flush` tokenizes the text held back; `end` closes the text."""

    req_id: str
    llm_replica: str
    text: str = ""
    flush: bool = False
    end: bool = False


@dataclass(frozen=True)
class MicPiece:
    """A piece of a microphone turn, sent by the Router to an LLM replica that tokenizes the turn's audio as
    it arrives (`LMAdapter.mic_tokenizer`, GLM-4-Voice's speech tokenizer): the first goes to any replica
    (`llm_replica` ""), its reply names the one holding the turn, and the request router pins the later
    ones there. `pcm16`: PCM16 mono at `sample_rate_hz`, in order (`seq` counts the pieces); `end` asks
    for the turn's tokens, `cancel` drops the turn."""

    turn_id: str
    llm_replica: str
    sample_rate_hz: int
    seq: int
    pcm16: bytes = b""
    end: bool = False
    cancel: bool = False


@dataclass(frozen=True)
class MicTokens:
    """An LLM replica's reply to a MicPiece: the replica holding the turn (its tag; "" = it does not hold
    it: a piece out of order, an unknown or expired turn, a replica at its turn limit), and at `end` the
    turn's speech tokens."""

    llm_replica: str
    tokens: tuple[int, ...] | None = None


@dataclass(frozen=True)
class HopTimes:
    """Wall-clock stamps (Unix seconds) of one chunk along the stage path; 0 = not reached yet.

    They let the router report where a chunk's time went (engine -> detokenizer -> audio ->
    client) without a tracing system; stages on other hosts skew them by the clock offset."""

    chunk_ready_unix_s: float = 0.0  # the LLM engine cut the TokenChunk
    detok_received_unix_s: float = 0.0  # the detokenizer engine queued it
    audio_ready_unix_s: float = 0.0  # its audio left the codec


@dataclass(frozen=True, eq=False)  # tensors: compared by identity
class VoiceConditioning:
    """A zero-shot voice as a flow-matching detokenizer (CosyVoice 2 / S3Gen) uses it, computed once
    from a reference clip: its speech tokens, their mel (2 frames per token) and the speaker x-vector."""

    voice_id: str
    prompt_tokens: torch.Tensor  # [P] long, speech tokens of the reference clip
    prompt_mel: torch.Tensor  # [2P, 80] float32, 24 kHz log-mel of the clip (hop 480)
    xvector: torch.Tensor  # [192] float32, CAM++ speaker embedding


@dataclass(frozen=True)
class TokenChunk:
    """Frames [window_start, window_end) of one request; samples of the kept frames are emitted.

    `frames` holds every frame of the window (context included) as lists of K codes.
    """

    req_id: str
    seq: int
    frames: list[list[int]]
    window_start: int
    keep_start: int
    keep_end: int
    is_final: bool
    deadline_s: float | None = None  # wall-clock time the client's buffer runs dry; None = startup (ASAP)
    hops: HopTimes = HopTimes()
    # Stateful flow detokenizers: the request's voice (None = the model's default), carried on every
    # chunk so a replica that never saw the request (cache miss) conditions it the same way.
    voice: VoiceConditioning | None = None
    # A registered zero-shot voice, by reference: its id, the handle under which the detok replica
    # keeps the voice's tensors (sent to it once over the stage transport, fetched again on a miss).
    voice_handle: str | None = None
    # Decoded again for a Router whose copy of its audio was lost while the stream goes on (`RouterCore._fetch`):
    # a detok replica decodes it on its own (`DetokEngine.submit`), leaving the stream's decode order and decoder
    # state there as they are, so the stream's later chunks do not wait for ones it decoded already.
    redo: bool = False

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    @property
    def kept_frames(self) -> tuple[tuple[int, ...], ...]:
        """The frames whose audio this chunk emits (its window minus the context frames)."""
        start = self.keep_start - self.window_start
        return tuple(tuple(f) for f in self.frames[start : start + self.keep_end - self.keep_start])


@dataclass
class AudioChunk:
    """PCM16 mono audio for one chunk of one request."""

    req_id: str
    seq: int
    pcm16: bytes
    sample_rate_hz: int
    is_final: bool
    detok_replica: str = ""  # set by the DetokStage deployment
    num_frames: int = 0  # codec frames the audio covers (0 = unknown)
    hops: HopTimes = HopTimes()

    @property
    def num_samples(self) -> int:
        return len(self.pcm16) // 2

    @property
    def duration_s(self) -> float:
        return self.num_samples / self.sample_rate_hz


@dataclass(frozen=True)
class AudioRef:
    """A decoded chunk as the LLM replica sees it: what its playback clock needs, and a handle to
    the audio, which stays in the detokenizer's object store until the router fetches it (the
    audio never passes through the LLM replica). One object holds the audio of every chunk of a
    decode call (an engine step's, all streams); `index` is this chunk's place in it. `chunk`
    decodes it again if the replica that holds the audio is lost before the router fetched it."""

    req_id: str
    seq: int
    is_final: bool
    duration_s: float
    num_frames: int
    handle: object  # ray.ObjectRef[list[AudioChunk]] (core stays free of Ray)
    chunk: TokenChunk
    index: int = 0  # this chunk's audio in the list behind `handle`
    detok_replica: str = ""  # the detok replica that decoded it (`DetokStage#<id>`)


# ---- stream events: LLM replica -> router --------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    """The job runs now on `llm_replica`; Audio events follow."""

    llm_replica: str


@dataclass(frozen=True)
class Queued:
    """The job waits for a KV slot on `llm_replica` (its deadline can still be met); Audio follows."""

    llm_replica: str


@dataclass(frozen=True)
class Rejected:
    """The replica is full: the client should retry after `retry_after_s`."""

    retry_after_s: float


@dataclass(frozen=True)
class Invalid:
    """The job cannot be served as asked: `field` is named as the client spelled it."""

    field: str
    message: str


@dataclass(frozen=True)
class AudioReady:
    """One decoded chunk, in seq order; `ref.is_final` ends the stream. The router fetches the
    audio itself from `ref.handle`. `checkpoint` (on the first chunk a step cut for the stream)
    is the sampler state the router keeps for resuming the stream on another replica."""

    ref: AudioRef
    checkpoint: Checkpoint | None = None


@dataclass(frozen=True)
class Moved:
    """The LLM replica handed the stream off: the router continues it elsewhere from `resume`,
    which carries the stream's KV; every chunk before `resume.next_seq` came first. A replica
    leaving (drain, node move-out) hands off every stream; one rebalancing (`router.rebalance`)
    hands off a few and stays."""

    resume: ResumeState
    llm_replica: str = ""  # the replica that handed it off
    is_leaving: bool = True  # routers pass over `llm_replica` from now on (False: only briefly)


@dataclass(frozen=True)
class Failed:
    """The stream broke inside the cluster (engine or detokenizer failure); nothing more follows."""

    message: str


StreamHead = Admitted | Queued | Rejected | Invalid | Moved | Failed
StreamEvent = Admitted | Queued | Rejected | Invalid | AudioReady | TextDelta | Moved | Failed

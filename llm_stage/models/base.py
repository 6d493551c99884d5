"""The LM-adapter contract every model family implements for the LLM engine.

An adapter formats prompts (text + voice -> tokens), embeds a batch of positions, owns the
backbone the engine drives, turns hidden states into logits ([B, C], or [B, K, C] for K
codebooks), applies its sampling rules, decides stops, and turns steps into codec frames.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import AudioFeatures, Job, SamplingParams
from core.voices import VoicePrompt
from detok_stage.codecs.base import CodecAdapter
from llm_stage.cfg import GuidanceFormula
from llm_stage.chunking import ChunkSchedule
from llm_stage.inner_loop import InnerLoop, InnerTable
from llm_stage.kv_cache import KVCache
from llm_stage.models.llama import BatchInputs
from llm_stage.request import Request, Token
from llm_stage.text_feed import TextFeed

# (logits [N, C], cand ids [N, C] | None, request of each row, codebook of each row) -> sampled ids [N]
DrawFn = Callable[[torch.Tensor, torch.Tensor | None, list[Request], list[int]], list[int]]


class Draws(Protocol):
    """The engine's draws for one step's rows (`llm_stage.step_draws.StepDraws`). Called as a `DrawFn`
    they return ids on the host; the families with an inner loop per frame (CSM, Qwen3-TTS) also draw
    on the device, so a frame's codebooks chain there and are read back once (`llm_stage.inner_loop`)."""

    graph_sizes: tuple[int, ...]  # batch sizes an inner loop pads to and captures (empty: eager)

    def __call__(
        self, logits: torch.Tensor, cand_ids: torch.Tensor | None, reqs: list[Request], codebooks: list[int]
    ) -> list[int]: ...

    def chains_on_device(self, reqs: list[Request]) -> bool:
        """Whether these rows' frame chains on the device (False: CPU logits sample in numpy, or a row
        samples repetition-aware: today's per-codebook host draws)."""
        ...

    def on_device(
        self, logits: torch.Tensor, cand_ids: torch.Tensor | None, reqs: list[Request], codebooks: list[int]
    ) -> torch.Tensor:
        """[N] ids on the logits' device, nothing read back (`sampler.sample_on_device`)."""
        ...

    def inner_table(self, reqs: list[Request], codebooks: range, device: torch.device) -> InnerTable | None:
        """The rows' sampling inputs for inner `codebooks` as device tensors; None when a row's draws
        there take a repetition penalty (the chain then draws each codebook with `on_device`)."""
        ...


class Backbone(Protocol):
    """The network the runner drives: embeddings, one forward over the slot KV cache, the LM head."""

    # whether its decode forward may be captured as CUDA graphs (then `forward` takes a fixed `length`)
    supports_decode_graphs: bool
    # whether a stream's whole state is its rows of the slot KV cache, so copying them moves it
    # to another engine (KV migration); otherwise a moved stream is prefilled again
    state_is_slot_kv: bool
    lm_head_weight: torch.Tensor  # [V, H]: its device and dtype are the KV cache's
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def forward(self, batch: BatchInputs, cache: KVCache, embeds: torch.Tensor | None = None) -> torch.Tensor: ...


class FrameBuilder(ABC):
    """Per-request: accumulates generated tokens, returns completed codec frames ([K] codes each)."""

    @abstractmethod
    def push(self, token_id: Token) -> list[list[int]]: ...


class CodeFrames(FrameBuilder):
    """Ids that `code_of` maps to a code become one-code frames; text and control ids (None) make none
    (the interleaved text + speech answers of the speech-in families)."""

    def __init__(self, code_of: Callable[[int], int | None]) -> None:
        self.code_of = code_of

    def push(self, token_id: Token) -> list[list[int]]:
        code = self.code_of(int(token_id))  # type: ignore[arg-type]
        return [] if code is None else [[code]]


class AudioFrontEnd(Protocol):
    """A speech-in family's front end on audio that arrives in pieces (streamed microphone input):
    PCM16 pushed as it comes, the features its encoder reads at `finish` (`Job.audio_features`)."""

    def push_pcm16(self, pcm16: bytes) -> None: ...

    def finish(self) -> AudioFeatures: ...


class MicAudioTokenizer(Protocol):
    """A speech-in family's tokenizer on one microphone turn, run by the LLM replica (it needs the model's
    weights) as the pieces arrive: PCM16 pushed as it comes, the turn's speech tokens at `finish`."""

    def push_pcm16(self, pcm16: bytes) -> None: ...

    def finish(self) -> torch.Tensor: ...


class LMAdapter(ABC):
    """One model family's LM side. Subclasses set the class attributes and `backbone`."""

    family: str = ""
    voices: tuple[str, ...] = ()
    no_voices_note = "none (speakers, if any, are tagged in the text)"  # `voxray models` when `voices` is empty
    default_voice: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    default_sampling: SamplingParams = SamplingParams()
    max_text_chars: int = 4000  # the one text-length limit the ingress applies
    num_codebooks: int = 1  # ids sampled per step; > 1 means logits are [B, K, C] and tokens are tuples
    input_width: int = 1  # lanes per position the runner hands to `embed`
    pad_token: Token = 0  # fills padded prefill positions (never attended to)
    guidance: GuidanceFormula | None = None  # CFG formula; None = the model has no CFG
    tokens_per_frame: int = 1  # ids sampled per codec frame, one engine step each
    # engine steps per second of audio / frames per second: `tokens_per_frame` unless the answer
    # interleaves other steps between frames (GLM-4-Voice's text); what pace and admission count
    steps_per_frame: float = 1.0
    head_phase_period: int = 1  # steps per cycle of the output head (rows in one phase share a head matmul)
    uses_context_turns: bool = False  # incremental streams: later segments get earlier ones as `Job.context`
    takes_registered_voices: bool = False  # zero-shot voices by id (`core.voices`), registered from a clip
    # `history_ids` maps each token on its own (a filter): the engine extends histories by new tokens only
    history_ids_per_token: bool = False
    voice_lm_speaker: bool = False  # a registered voice also carries the LM's speaker conditioning (SpeakerPrompt)
    # a registered voice's transcript prompts the LM, with its speech tokens (CosyVoice 2's zero-shot mode); such a
    # family takes `voices.default_clip_text` as the default voice's (`set_default_voice_prompt`)
    reads_voice_transcript: bool = False
    # every voice's prompt is as long as the default voice's (Chatterbox: a speaker row, the perceiver's fixed
    # queries, the emotion position): the Router counts any voice as the default one its replicas report
    # (`ReplicaLoad.default_voice_positions`), where its own count would need the model's layout
    voices_alike: bool = False
    # a streamed-text request can resume on another replica: its positions read the feed by index,
    # so the text replayed in the order it came gives them the same ids (not a family that lays
    # text positions out between its sampled tokens as they come: CosyVoice 2's bistream)
    resumes_streamed_text: bool = False
    takes_audio: bool = False  # speech in: a Job may carry `audio` (`Job.audio`), encoded in `prepare_step`
    # speech in: a Job may ask for a text-only answer (`Job.text_only`: no speech ids drawn, no chunks) and
    # set its system turn (`Job.system`); `transcription_system` gives a transcription's
    answers_text_only: bool = False
    takes_chat_history: bool = False  # speech in: a Job may carry a conversation's earlier turns (`Job.history`)
    # speech in: a streamed turn's audio is tokenized on an LLM replica as it arrives (`mic_tokenizer`)
    tokenizes_mic_audio: bool = False
    # its prompt ids are its content (no embeddings from elsewhere, e.g. an encoder's at placeholder ids), so a
    # request's prompt KV may serve a later request whose prompt starts the same (`llm_stage.kept_prompts`)
    reuses_prompt_kv: bool = False
    # text characters per prompt position, to estimate a prompt before it is tokenized (admission,
    # `estimate_prompt_positions`): a BPE tokenizer's ~4 on English
    prompt_chars_per_position: float = 4.0
    # a frame's inner loop chained on the device, one CUDA graph per batch size (CSM, Qwen3-TTS); None: none
    inner_loop: InnerLoop | None = None
    # a step's prompt positions may run as more rows of the decode forward (on CUDA, `ModelRunner.fold_prefill`);
    # False where a prompt position's embedding is chosen on the host (Step-Audio 2's audio placeholders)
    folds_prompts: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A family that sets `tokens_per_frame` and not `steps_per_frame` steps once per token."""
        super().__init_subclass__(**kwargs)
        if "tokens_per_frame" in cls.__dict__ and "steps_per_frame" not in cls.__dict__:
            cls.steps_per_frame = float(cls.tokens_per_frame)

    def __init__(self, backbone: Backbone) -> None:
        self.backbone = backbone

    @classmethod
    def audio_front_end(cls, sample_rate_hz: int) -> AudioFrontEnd | None:
        """A front end for a turn streamed at `sample_rate_hz` (None: the family takes no streamed audio).
        The Router runs it as the audio arrives, without the model's weights."""
        return None

    def front_end_seconds(self, job: Job) -> float:
        """Seconds of `job`'s audio whose front end its `job_prompt` just ran here (the engine times it per
        second: `prefill_pace`): its clip unless its features or tokens came with it."""
        came_encoded = job.audio_features is not None or job.audio_tokens is not None
        return job.audio.duration_s if job.audio is not None and not came_encoded and self.takes_audio else 0.0

    def forget_kept_clips(self) -> None:
        """Drop what the adapter keeps of clips it saw, by content (speech-in families: their tokens or
        encoded rows), for a cold start (benches, tests); only while no request runs."""
        return None

    def mic_tokenizer(self, sample_rate_hz: int) -> MicAudioTokenizer | None:
        """A tokenizer for one turn streamed at `sample_rate_hz` (families with `tokenizes_mic_audio`; None:
        not here). The LLM replica feeds it the turn's pieces; its tokens come back in `Job.audio_tokens`."""
        return None

    @classmethod
    def build(cls, config: ModelConfig) -> LMAdapter:
        """The adapter on a local checkpoint (`config.checkpoint_dir`) or on the family's preset."""
        raise NotImplementedError(f"{cls.__name__} is built in code, not from a ModelConfig")

    @abstractmethod
    def format_prompt(self, text: str, voice: str | None) -> list[Token]:
        """Prompt tokens for validated text and voice (`llm_stage.jobs.build_job` checked both)."""

    def unconditional_prompt(self, text: str, voice: str | None) -> list[Token]:
        """The prompt of a guided request's hidden twin (override with `guidance`)."""
        raise InvalidArgumentError("sampling.guidance_scale", f"{self.family} has no classifier-free guidance")

    @classmethod
    def transcription_system(cls, language: str | None) -> str:
        """The system turn that asks a speech-in family to transcribe the clip (`language`: ISO-639-1, or
        None); a family or language it has no instruction for is refused, naming the field."""
        if language is None:
            raise InvalidArgumentError("model", f"{cls.family} does not transcribe (it takes no audio)")
        raise InvalidArgumentError("language", f"{cls.family} has no transcription instruction for {language!r}")

    @classmethod
    def audio_prompt_positions(cls, duration_s: float) -> int:
        """Prompt positions a clip of `duration_s` takes in this family's prompt (0: it takes no audio)."""
        return 0

    @classmethod
    def twin_prompt_positions(cls, positions: int) -> int:
        """The prompt positions of a guided request's hidden twin (`unconditional_prompt`) when its own prompt
        has `positions`: as many by default (Dia's zero text, Chatterbox's unconditional text and its voice
        rows, are as long as the guided prompt)."""
        return positions

    @classmethod
    def estimate_prompt_positions(cls, job: Job) -> int:
        """The prompt positions `job` will take, estimated from the Job alone (no tokenizer, no weights:
        the Router's admission, before the job reaches a replica): its text and its earlier turns' at
        `prompt_chars_per_position`, and every clip's positions (`audio_prompt_positions`)."""
        clips = [job.audio, *(turn.audio for turn in job.history)]  # a conversation prefills every turn again
        chars = len(job.text) + sum(len(turn.text) for turn in job.history)
        text_positions = math.ceil(chars / cls.prompt_chars_per_position)
        return text_positions + sum(cls.audio_prompt_positions(clip.duration_s) for clip in clips if clip is not None)

    @classmethod
    def registered_voice_positions(cls, prompt: VoicePrompt) -> int:
        """Prompt positions a registered voice adds, from its `VoicePrompt` alone (no weights: the Router's estimate,
        `router.voices.VoiceRegistry`); 0 where its LM takes no voice prompt or the count needs the model."""
        return 0

    def voice_prompt_positions(self, voice: str | None) -> int:
        """Prompt positions `voice` adds to a request's prompt beyond its text, on this replica: a registered
        voice it has looked up (`add_voice_prompt`), or the default voice's (None). The Router's estimate
        counts a registered voice by `registered_voice_positions`; the replica's admission adds these. 0: the
        family's LM takes no voice prompt (a voice name in its text, or a voice for the detokenizer alone)."""
        return 0

    @property
    def pending_audio_s(self) -> float:
        """Seconds of audio the next `prepare_step` encodes (the engine times the encoder by it)."""
        return 0.0

    def job_prompt(self, job: Job) -> list[Token]:
        """The prompt of a validated job; override to condition on per-request fields of `job.sampling`."""
        return self.format_prompt(job.text, job.voice)

    @classmethod
    def continue_text(cls, text: str, previous: tuple[str, ...]) -> str:
        """An incremental stream's next segment as the model should read it, given the segments
        before it (override to carry text-level context, e.g. Dia's speaker tag)."""
        return text

    def streaming_prompt(self, job: Job) -> tuple[list[Token], TextFeed]:
        """Native text streaming (families with `ModelFamily.streams_text`): the prompt and the feed its
        later positions read the streamed text from, holding `job.text`, the first piece."""
        raise InvalidArgumentError("text_streaming", f"{self.family} reads its text whole (segment pipelining)")

    def unconditional_job_prompt(self, job: Job) -> list[Token]:
        """The prompt of a guided job's hidden twin."""
        return self.unconditional_prompt(job.text, job.voice)

    def token_lanes(self, token: Token) -> list[int]:
        """One position as `input_width` ints for the runner's [B, T, W] id tensor."""
        return [token] if isinstance(token, int) else list(token)

    def lanes_at(self, req: Request, index: int) -> list[int]:
        """The lanes of `req`'s position `index` (prompt + output); override when they depend on where the
        token sits (e.g. a learned position of generated tokens)."""
        return self.token_lanes(req.token_at(index))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T, W] -> input embeddings [B, T, H]."""
        return self.backbone.embed(ids[..., 0])

    def decode_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """`embed` of a decode forward's rows, what a decode CUDA graph captures: sampled tokens, and the
        prompt positions folded in where the family folds them (`folds_prompts`). Must not wait for the
        device. By default `embed`."""
        return self.embed(ids)

    def logits(self, hidden: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, H] -> (logits [B, C] or [B, K, C], vocab id per column or None when C is the vocab)."""
        return hidden @ self.backbone.lm_head_weight.T, None

    def history_ids(self, tokens: list[Token], codebook: int) -> list[int]:
        """The ids of `codebook` among prompt + output `tokens` that the repetition penalty looks at."""
        if self.num_codebooks > 1:  # per-codebook history over the generated frames
            return [t[codebook] for t in tokens if isinstance(t, tuple)]
        return tokens  # type: ignore[return-value]

    def is_stop(self, req: Request, token: Token) -> bool:
        """Whether sampling `token` ends `req` (the token is then not appended)."""
        return token in self.eos_token_ids

    def penalty_history(self, req: Request, codebook: int) -> list[int]:
        """The ids the repetition penalty of `req`'s draw for `codebook` looks at: by default
        `history_ids` of the last `repetition_window` positions of prompt + output."""
        return self.history_ids(req.history(req.sampling.repetition_window), codebook)

    def drawn_ids(self, req: Request, codebook: int) -> list[int]:
        """The ids `req` drew for `codebook`, in order, that repetition-aware sampling looks back on:
        by default its output (the codebook's ids, for K codebooks)."""
        return [t if isinstance(t, int) else t[codebook] for t in req.output_ids]

    def record_token(self, req: Request, token: Token) -> None:
        """Record a sampled token that did not stop `req`: by default every row's next output and next
        position. A family that lays out its own positions (`Request.positions`: text between sampled
        tokens) places them here; more than one new position is prefilled, sampling at the last."""
        for row in req.unit:
            row.output_ids.append(token)

    def is_output(self, req: Request, token: Token) -> bool:
        """Whether a sampled `token` that did not stop `req` is output (frames, audio); False for a
        control token (CosyVoice 2's fill token, which asks for more streamed text)."""
        return True

    def text_arrived(self, req: Request) -> None:
        """A streaming-text request got text (or its end): lay out the positions it now determines
        (families that place text positions themselves; the engine then schedules them)."""
        return None

    def constrain(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Model sampling rules on the (CFG-merged) logits, e.g. forced BOS / EOS per codebook."""
        return logits

    def sample_tokens(
        self, hidden: torch.Tensor, logits: torch.Tensor, cand: torch.Tensor | None, reqs: list[Request], draw: Draws
    ) -> list[Token]:
        """Visible rows' hidden [B, H] and merged logits -> one token per row (an int, or K ids)."""
        logits = self.constrain(logits, reqs)
        if logits.dim() == 2:
            return draw(logits, cand, reqs, [0] * len(reqs))
        num_rows, num_codebooks = logits.shape[:2]
        flat_cand = None if cand is None else cand.flatten(0, 1)
        rows = [r for r in reqs for _ in range(num_codebooks)]
        ids = draw(logits.flatten(0, 1), flat_cand, rows, list(range(num_codebooks)) * num_rows)
        return [tuple(ids[b * num_codebooks : (b + 1) * num_codebooks]) for b in range(num_rows)]

    def prepare_step(self) -> None:
        """Called by the engine before each step: batched preprocessing of the requests added since the
        last one (speech in: one encoder forward over their audio) before their prefill reads it."""
        return None

    def forget(self, req_id: str) -> None:
        """A request ended (finished, cancelled, shed): drop what the adapter keeps for it."""
        return None

    def text_ids(self, tokens: list[int]) -> list[int]:
        """The ids among a step's output `tokens` that the client reads as text (families that answer
        in text beside audio); none by default."""
        return []

    def decode_text(self, ids: list[int]) -> str:
        """The text of ids `text_ids` picked (families that answer in text)."""
        return ""

    @abstractmethod
    def new_frame_builder(self) -> FrameBuilder: ...


@dataclass(frozen=True)
class ModelFamily:
    """A model family, declared once next to its LM adapter as `FAMILY`; `llm_stage.registry`
    serves it as `<name>` (local checkpoint directories) and `<name>-tiny` (random preset).
    Voices, sampling defaults and the token layout are the adapter's class attributes."""

    name: str
    description: str
    preset_description: str
    lm: type[LMAdapter]
    codec: type[CodecAdapter]
    sample_rate_hz: int  # of the codec's output, checkpoint and preset alike
    frame_rate_hz: float  # codec frames per second of the published codec (the preset may differ)
    repo_id: str | None = None  # the published checkpoint this family serves, e.g. canopylabs/orpheus-3b-0.1-ft
    codec_repo_id: str | None = None  # the published codec, loaded when `ModelConfig.codec_dir` is None
    codec_in_checkpoint: bool = False  # the checkpoint carries its codec's weights (CSM's Mimi)
    # the published speech tokenizer a checkpoint model reads the user's audio with, loaded when
    # `ModelConfig.speech_tokenizer_dir` is None (GLM-4-Voice's WhisperVQ)
    speech_tokenizer_repo_id: str | None = None
    # whether a checkpoint's config.json is this family's (so `--model REF` finds the family)
    is_checkpoint: Callable[[dict[str, Any]], bool] = lambda config: False
    # a file that marks this family's published directory when it has no config.json
    # (CosyVoice2-0.5B: cosyvoice2.yaml; chatterbox: t3_cfg.safetensors)
    checkpoint_marker: str | None = None
    # the chunk schedule `detok.schedule: auto` uses: the family's detokenizer needs its own
    # (None = the wide fields of DetokConfig)
    chunk_schedule: ChunkSchedule | None = None
    # native text streaming: the LM reads text while it speaks (`LMAdapter.streaming_prompt`), so an
    # incremental stream is one request fed text pieces, not a request per text segment
    streams_text: bool = False

    @property
    def tokens_per_s(self) -> float:
        """LM steps per second of audio (each step samples `num_codebooks` ids at once)."""
        return self.frame_rate_hz * self.lm.steps_per_frame

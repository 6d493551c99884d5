"""Step-Audio 2 mini LM side: speech in (audio encoder -> embeddings at the audio placeholders of a
Qwen2.5 prompt), interleaved text and 25 Hz speech tokens out (decoded by the published token2wav/:
`detok_stage.codecs.step_audio2_codec`).

The prompt is the published chat: `<|BOT|>system\\n{system}<|EOT|>`, a conversation's earlier turns
(`Job.history`: user turns as the last one, assistant turns as text answers), then
`<|BOT|>human\\n{text}` and per 25 s piece of the user's audio `<audio_start>` + one `<audio_patch>` per
embedding + `<audio_end>`, then `<|EOT|><|BOT|>assistant\\n<tts_start>` (answer in speech), or without
`<tts_start>` for a text-only answer (`Job.text_only`, as the published ASR example: its draws are then held to text ids
and `<|EOT|>`, so no speech id and no chunk is ever made). A position is (id, clip handle,
row): text and markers carry handle -1; a placeholder names the rows of its clip's embeddings, which
`embed` writes over the placeholder's own. Clips are turned into log-mels when a job arrives (a
streamed turn's come with it, computed as its audio arrived: `step_audio2_frontend`) and encoded in
one batched forward for every clip that arrived since the last step (`prepare_step`), the LLM
replica's preprocess; their rows are kept until the request ends (a re-prefill reads
them again). Output: text ids go to the client as text, `<audio_N>` to the detokenizer as code N,
`<|EOT|>` stops. Weights and ids: `llm_stage.models.step_audio2_lm`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from types import SimpleNamespace

import torch

from core.checkpoints import resolve_model_ref
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import AudioClip, ChatTurn, Job, SamplingParams
from core.voices import VoicePrompt
from detok_stage.codecs.step_audio2_codec import REBUILD_CHUNK_TOKENS, StepAudio2Codec
from llm_stage.chunking import whole_stream_schedule
from llm_stage.models.base import CodeFrames, LMAdapter, ModelFamily
from llm_stage.models.clip_audio import clip_key, clip_wave
from llm_stage.models.clip_rows import ClipRows
from llm_stage.models.llama import LlamaBackbone
from llm_stage.models.step_audio2_encoder import (
    MEL_HOP_SAMPLES,
    SAMPLE_RATE_HZ,
    EncoderShape,
    clip_positions,
    encode_pieces,
    num_placeholders,
    piece_log_mel,
    split_pieces,
)
from llm_stage.models.step_audio2_frontend import MicFrontEnd, front_end_name, whole_clip_features
from llm_stage.models.step_audio2_lm import (
    PRESET_TEXT_IDS,
    SpecialIds,
    StepAudio2LM,
    is_step_audio2_config,
    load_step_audio2,
)
from llm_stage.models.tokenizers import ByteTokenizer, HFTokenizer, TextTokenizer
from llm_stage.request import Request, Token

SYSTEM_PROMPT = "You are a helpful assistant."  # the published examples' system turn
# the published ASR examples' system turn, by language (examples.py: Chinese, its English in a comment)
TRANSCRIPTION_SYSTEM = {"en": "Please record the audio content you hear.", "zh": "请记录下你所听到的语音内容。"}
NO_CLIP = -1
# the chat's markers (<|BOT|> x3, <|EOT|> x2, <tts_start>) and role names ("system\n", "human\n",
# "assistant\n": ~2 BPE tokens each): the prompt's positions beside its text and audio
CHAT_MARKER_POSITIONS = 12


class StepAudio2Adapter(LMAdapter):
    family = "step-audio2"
    takes_audio = True
    answers_text_only = True
    takes_chat_history = True
    # a clip's placeholders carry its content handle (`ClipRows`): a conversation's next turn reuses the KV
    reuses_prompt_kv = True
    no_voices_note = ("none built in; speech in (takes audio), answers in text + speech in the token2wav "
                      "default voice or a zero-shot voice from a reference clip (POST /v1/voices, gRPC RegisterVoice)")
    # zero-shot voices by id: the LM is not conditioned on the speaker (the published model speaks through
    # token2wav's prompt audio), so a voice conditions only the detokenizer, which fetches it by handle
    takes_registered_voices = True
    # a placeholder's rows are picked by `embed` on the host's say-so, so prompts do not fold into the decode
    # forward; its rows are sampled tokens alone (`decode_embed`), which a decode graph captures
    folds_prompts = False
    input_width = 3  # (id, clip handle, row in the clip's embeddings)
    max_text_chars = 4000
    # the published examples' sampling (temperature 0.7, top_p 0.9, repetition_penalty 1.05)
    default_sampling = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.05, max_tokens=4096)

    def __init__(self, model: StepAudio2LM, tokenizer: TextTokenizer, ids: SpecialIds = SpecialIds()) -> None:
        shim = SimpleNamespace(config=model.text_config, model=model.model, lm_head=model.lm_head)
        super().__init__(LlamaBackbone(shim))  # type: ignore[arg-type]
        self.model, self.tokenizer, self.ids = model, tokenizer, ids
        self.pad_token = (0, NO_CLIP, 0)
        self.eos_token_ids = frozenset({ids.eot})
        self.clips = ClipRows()  # encoded clip pieces by content: a clip sent again is not encoded again
        self._front_end_s = 0.0  # seconds of audio the last `job_prompt` ran the front end on
        self._text_only: set[str] = set()  # req_ids answering in text alone (`constrain` masks speech)
        self.voice_prompts: dict[str, VoicePrompt] = {}  # registered voices this replica has looked up

    @classmethod
    def audio_front_end(cls, sample_rate_hz: int) -> MicFrontEnd:
        """The published front end (128 mel bins); a checkpoint with other bins recomputes from the clip."""
        return MicFrontEnd(sample_rate_hz, EncoderShape().n_mels)

    @classmethod
    def build(cls, config: ModelConfig) -> StepAudio2Adapter:
        """The published directory (its tokenizer gives the special ids by name) or the tiny preset."""
        model = load_step_audio2(config)
        if config.checkpoint_dir is None:
            return cls(model, ByteTokenizer(offset=PRESET_TEXT_IDS.start, bos_id=None))
        directory = resolve_model_ref(config.checkpoint_dir)
        tokenizer = HFTokenizer(directory, add_special_tokens=False)
        return cls(model, tokenizer, SpecialIds.from_vocab(tokenizer.vocab()))

    def add_voice_prompt(self, prompt: VoicePrompt) -> None:
        """A registered voice is known here (`deployments.voices`); its transcript and speech tokens are not
        read: the LM's prompt is the same in every voice."""
        self.voice_prompts[prompt.voice_id] = prompt

    # prompts

    def format_prompt(self, text: str, voice: str | None) -> list[Token]:
        return self.chat_prompt(text, [], "")

    @classmethod
    def transcription_system(cls, language: str | None) -> str:
        """The published ASR instruction (English unless `language` is "zh"); other languages are refused."""
        if language is not None and language not in TRANSCRIPTION_SYSTEM:
            served = ", ".join(TRANSCRIPTION_SYSTEM)
            raise InvalidArgumentError("language", f"{language!r} is not served; Step-Audio 2 transcribes {served}")
        return TRANSCRIPTION_SYSTEM[language or "en"]

    @classmethod
    def audio_prompt_positions(cls, duration_s: float) -> int:
        """The clip's placeholders and audio markers at the published encoder's geometry (~12.5 per second)."""
        return clip_positions(duration_s)

    @classmethod
    def estimate_prompt_positions(cls, job: Job) -> int:
        """The user's text and audio, the system turn and the chat's markers around them."""
        system_positions = math.ceil(len(job.system or SYSTEM_PROMPT) / cls.prompt_chars_per_position)
        return super().estimate_prompt_positions(job) + system_positions + CHAT_MARKER_POSITIONS

    def job_prompt(self, job: Job) -> list[Token]:
        """The job's conversation in the published chat; its clips (earlier turns' first) queued to encode,
        but those encoded here before (`ClipRows`: a conversation's earlier turns come back every turn)."""
        if job.text_only:
            self._text_only.add(job.req_id)
        self._front_end_s = 0.0
        earlier = [token for turn in job.history for token in self.earlier_turn(job.req_id, turn)]
        computed_s = job.audio.duration_s if job.audio is not None and job.audio_features is None else 0.0
        pieces = [] if job.audio is None else self.clip_pieces(job.req_id, job.audio, lambda: self.clip_mels(job),
                                                               computed_s)  # fmt: skip
        system = job.system or SYSTEM_PROMPT
        return self.chat_prompt(job.text, pieces, job.req_id, system, speaks=not job.text_only, earlier=earlier)

    def clip_mels(self, job: Job) -> list[torch.Tensor]:
        """The log-mel of each 25 s piece of the job's audio: the features computed as it arrived
        (streamed microphone input) when they are this front end's, else the same front end run on
        the whole clip now (bit-equal either way)."""
        n_mels = self.model.encoder_shape.n_mels
        features = job.audio_features
        if features is None or features.front_end != front_end_name(n_mels):
            return self.whole_clip_mels(job.audio)
        return [torch.from_numpy(mel) for mel in features.mels]

    def whole_clip_mels(self, clip: AudioClip) -> list[torch.Tensor]:
        """The log-mel of each 25 s piece of a whole clip, through the front end a streamed turn uses."""
        features = whole_clip_features(clip_wave(clip), clip.sample_rate_hz, self.model.encoder_shape.n_mels)
        return [torch.from_numpy(mel) for mel in features.mels]

    def earlier_turn(self, req_id: str, turn: ChatTurn) -> list[Token]:
        """An earlier turn as published: a user's text and clip (queued, encoded like the last turn's), or
        the assistant's answer as its text turn `<|BOT|>assistant\n{text}<|EOT|>`. The published history of
        a spoken answer is `<tts_start>` and every id the model drew (text and speech interleaved); a
        client gives back only the transcript, so it becomes the text answer the model itself writes."""
        if turn.role == "user":
            clip = turn.audio
            pieces = [] if clip is None else self.clip_pieces(req_id, clip, lambda: self.whole_clip_mels(clip))
            return self.user_turn(turn.text, pieces)
        body = [self.ids.bot, *self.tokenizer.encode("assistant\n"), *self.tokenizer.encode(turn.text), self.ids.eot]
        return [(i, NO_CLIP, 0) for i in body]

    def chat_prompt(
        self,
        text: str,
        pieces: list[tuple[int, int]],
        req_id: str,
        system: str = SYSTEM_PROMPT,
        speaks: bool = True,
        earlier: list[Token] = (),
    ) -> list[Token]:
        """The published chat: the system turn, the `earlier` turns' tokens, the last user turn (text, then
        each audio piece as (handle, rows)), the assistant's turn opened in speech (`<tts_start>`) or,
        `speaks` False, in text."""
        if not text and not pieces:
            raise InvalidArgumentError("text", "has no tokens and no audio came with it")
        ids = self.ids
        head = [ids.bot, *self.tokenizer.encode(f"system\n{system}"), ids.eot]
        tail = [ids.bot, *self.tokenizer.encode("assistant\n"), *([ids.tts_start] if speaks else [])]
        user = self.user_turn(text, pieces)
        return [(i, NO_CLIP, 0) for i in head] + list(earlier) + user + [(i, NO_CLIP, 0) for i in tail]

    def user_turn(self, text: str, pieces: list[tuple[int, int]]) -> list[Token]:
        """`<|BOT|>human\n{text}`, each audio piece as `<audio_start>` + its placeholders + `<audio_end>`, `<|EOT|>`."""
        ids = self.ids
        body = [ids.bot, *self.tokenizer.encode("human\n"), *(self.tokenizer.encode(text) if text else [])]
        turn: list[Token] = [(i, NO_CLIP, 0) for i in body]
        for handle, rows in pieces:
            turn.append((ids.audio_start, NO_CLIP, 0))
            turn += [(ids.audio_patch, handle, row) for row in range(rows)]
            turn.append((ids.audio_end, NO_CLIP, 0))
        return turn + [(ids.eot, NO_CLIP, 0)]

    def queue_clip(self, req_id: str, wave_16k: torch.Tensor) -> list[tuple[int, int]]:
        """The 16 kHz clip's 25 s pieces through the published front end (`piece_log_mel`), queued."""
        n_mels = self.model.encoder_shape.n_mels
        mels = [piece_log_mel(piece, n_mels) for piece in split_pieces(wave_16k)]
        key = hashlib.blake2b(wave_16k.numpy().tobytes(), digest_size=16).digest()
        return self.clips.pieces(req_id, key, lambda: mels, self._placeholders)[0]

    def clip_pieces(
        self, req_id: str, clip: AudioClip, mels: Callable[[], list[torch.Tensor]], front_end_s: float | None = None
    ) -> list[tuple[int, int]]:
        """The clip's (handle, placeholder rows) per 25 s piece, held for `req_id`: a clip known here as it
        was, else `mels()` queued for the next step's batched encode (its front end then timed for
        `front_end_s`, the whole clip's seconds by default)."""
        pieces, is_new = self.clips.pieces(req_id, clip_key(clip), mels, self._placeholders)
        if is_new:
            self._front_end_s += clip.duration_s if front_end_s is None else front_end_s
        return pieces

    def _placeholders(self, mel: torch.Tensor) -> int:
        return num_placeholders(mel.shape[1], self.model.encoder_shape)

    def front_end_seconds(self, job: Job) -> float:
        return self._front_end_s

    def forget_kept_clips(self) -> None:
        self.clips = ClipRows()

    def prepare_step(self) -> None:
        """Encode every clip queued since the last step in one forward (before the step's prefill reads them)."""
        self.clips.encode(lambda mels: encode_pieces(self.model.encoder, self.model.adapter, mels))

    def forget(self, req_id: str) -> None:
        self._text_only.discard(req_id)
        self.clips.release(req_id)

    @property
    def pending_audio_s(self) -> float:
        """Seconds of the clips queued for the next step's encode (10 ms per log-mel frame)."""
        return sum(mel.shape[1] for _, mel in self.clips.pending) * MEL_HOP_SAMPLES / SAMPLE_RATE_HZ

    @property
    def num_pending_clips(self) -> int:
        return len(self.clips.pending)

    # the forward

    def token_lanes(self, token: Token) -> list[int]:
        return [token, NO_CLIP, 0] if isinstance(token, int) else list(token)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T, 3] -> [B, T, H]: token embeddings, audio placeholders replaced by their clip's rows."""
        token, handle, row = ids.unbind(-1)
        out = self.backbone.embed(token)
        rows = self.clips.rows
        if not rows:
            return out
        is_audio = handle != NO_CLIP
        if not bool(is_audio.any()):
            return out
        for clip in handle[is_audio].unique().tolist():
            where = handle == clip
            out[where] = rows[clip].to(out.dtype)[row[where]]
        return out

    def decode_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """A decode forward's rows are sampled tokens, never audio placeholders: their token embeddings
        (no host branch, so the decode forward replays as a CUDA graph)."""
        return super().embed(ids)

    def constrain(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """logits [B, vocab]: a text-only answer's rows may draw only text ids and `<|EOT|>` (no
        `<tts_start>`, no speech id, no audio framing, no `<|BOT|>`)."""
        rows = [i for i, req in enumerate(reqs) if req.req_id in self._text_only]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            logits[index, self.ids.audio_start :] = float("-inf")
            logits[index, self.ids.bot] = float("-inf")
        return logits

    def is_stop(self, req: Request, token: Token) -> bool:
        return token == self.ids.eot

    def history_ids(self, tokens: list[Token], codebook: int) -> list[int]:
        """Every id of prompt + output (placeholders count as `<audio_patch>`, as published)."""
        return [t if isinstance(t, int) else t[0] for t in tokens]

    def new_frame_builder(self) -> CodeFrames:
        return CodeFrames(self.ids.speech_code)

    def text_ids(self, tokens: list[int]) -> list[int]:
        """The ids among `tokens` that the client reads as text."""
        return [t for t in tokens if self.ids.is_text(t)]

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)  # type: ignore[attr-defined]


FAMILY = ModelFamily(
    name="step-audio2",
    description="Step-Audio 2 mini: speech in (Whisper-style encoder + adapter into a Qwen2.5-7B LM), text and "
    "25 Hz CosyVoice 2 speech tokens out (1 text : 4 speech), decoded by its own token2wav/ (V2 conformer + DiT flow, "
    "HiFT)",
    preset_description="Step-Audio 2 layout: the published 158720-token vocabulary and id ranges, a tiny random Qwen2 "
    "LM and audio encoder + tiny random token2wav detokenizer (DiT flow, HiFT)",
    lm=StepAudio2Adapter,
    codec=StepAudio2Codec,
    sample_rate_hz=24000,
    frame_rate_hz=25.0,
    # a stepfun-ai/Step-Audio-2-mini directory serves whole: its token2wav/ (flow.pt, hift.pt) is the detokenizer
    repo_id="stepfun-ai/Step-Audio-2-mini",
    codec_in_checkpoint=True,
    is_checkpoint=is_step_audio2_config,
    # the published streaming: 25-token chunks sent with their 3 look-ahead tokens (the whole stream as
    # left context, so a cold replica rebuilds the request)
    chunk_schedule=whole_stream_schedule(
        REBUILD_CHUNK_TOKENS, REBUILD_CHUNK_TOKENS, StepAudio2Codec.min_right_context_frames
    ),
)

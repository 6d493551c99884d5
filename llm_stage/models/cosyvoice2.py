"""CosyVoice 2 LM side: a Qwen2.5-0.5B body over text and 25 Hz speech tokens (6561 + 3 stop ids).

A prompt is `[sos, text, task_id, prompt speech]`: sos / task_id are rows of `llm_embedding`, text
ids embed through Qwen's own table, speech ids through `speech_embedding`; `llm_decoder` (with bias)
scores the 6564 speech ids. Each position carries (id, kind) lanes so one batch mixes all three
tables. Per request, stop ids are masked for the first 2x text tokens and forced after 20x (the
published bounds). Streamed text (native text streaming, the published "bistream"): the prompt is
`sos` and `llm_stage.models.cosyvoice2_bistream` lays out the text between the speech tokens.
Weights: `llm_stage.models.cosyvoice2_lm`.
"""

from __future__ import annotations

import math
import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from core.checkpoints import resolve_model_ref
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import Job, SamplingParams
from core.voices import VoicePrompt
from detok_stage.codecs.s3gen_codec import STREAM_CHUNK_TOKENS, S3GenCodec
from llm_stage.chunking import whole_stream_schedule
from llm_stage.models.base import FrameBuilder, LMAdapter, ModelFamily
from llm_stage.models.cosyvoice2_bistream import FILL_TOKEN, BistreamFeed
from llm_stage.models.cosyvoice2_lm import (
    QWEN_DIR,
    SOS,
    SPEECH_TOKEN_SIZE,
    TASK_ID,
    TEXT_SPECIAL_TOKENS,
    CosyVoice2LM,
    Kind,
    load_cosyvoice2_lm,
    published_sampling,
    read_published_settings,
)
from llm_stage.models.llama import LlamaBackbone
from llm_stage.models.tokenizers import ByteTokenizer, HFTokenizer, TextTokenizer
from llm_stage.request import Request, Token
from llm_stage.text_feed import NO_LIMIT, TextFeed, split_last_word, split_whole

EOS_TOKEN = SPEECH_TOKEN_SIZE  # the stop id the published loop masks before the minimum length
STOP_TOKENS = frozenset(SPEECH_TOKEN_SIZE + i for i in range(3))  # 6561..6563 all end a request
FRAME_RATE_HZ = 25.0
MIN_TOKEN_TEXT_RATIO, MAX_TOKEN_TEXT_RATIO = 2, 20


class SpeechFrameBuilder(FrameBuilder):
    """Every generated token is one 25 Hz frame of one speech code."""

    def push(self, token_id: Token) -> list[list[int]]:
        return [[int(token_id)]]  # type: ignore[arg-type]


def check_speech_tokens(speech: list[int]) -> None:
    bad = next((s for s in speech if not 0 <= s < SPEECH_TOKEN_SIZE), None)
    if bad is not None:
        raise InvalidArgumentError("voice", f"prompt speech token {bad} is outside [0, {SPEECH_TOKEN_SIZE})")


class CosyVoice2Adapter(LMAdapter):
    family = "cosyvoice2"
    voices: tuple[str, ...] = ()  # no built-in speakers: voices come from reference clips (zero-shot)
    no_voices_note = "none built in; zero-shot voices from a reference clip (POST /v1/voices, gRPC RegisterVoice)"
    takes_registered_voices = True
    reads_voice_transcript = True
    history_ids_per_token = True  # speech ids only, each token on its own
    eos_token_ids = STOP_TOKENS
    input_width = 2  # (id, Kind)
    pad_token = (0, Kind.TEXT)
    # the published cosyvoice2.yaml: ras_sampling(top_p=0.8, top_k=25, win_size=10, tau_r=0.1) on log-probs (T = 1)
    default_sampling = SamplingParams(temperature=1.0, top_p=0.8, top_k=25, ras_window=10, ras_tau=0.1, max_tokens=1500)

    def __init__(
        self, model: CosyVoice2LM, tokenizer: TextTokenizer, default_sampling: SamplingParams | None = None
    ) -> None:
        qwen = model.qwen
        sliding = [t for t in getattr(qwen.config, "layer_types", None) or [] if t != "full_attention"]
        if sliding:
            raise InvalidArgumentError("model.checkpoint_dir", f"the Qwen body has {sliding[0]} layers; unsupported")
        shim = SimpleNamespace(config=qwen.config, model=qwen.model, lm_head=model.llm_decoder)
        super().__init__(LlamaBackbone(shim))  # type: ignore[arg-type]
        self.model, self.tokenizer = model, tokenizer
        if default_sampling is not None:
            self.default_sampling = default_sampling
        self._text_len: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        self.voice_prompts: dict[str, VoicePrompt] = {}  # registered voices this replica has looked up
        self.default_voice_prompt: VoicePrompt | None = None  # a request naming no voice (`voices.default_clip_text`)

    @classmethod
    def build(cls, config: ModelConfig) -> CosyVoice2Adapter:
        """The published CosyVoice2-0.5B directory (weights, its Qwen tokenizer with CosyVoice's markers,
        the yaml's sampling) or the tiny preset (byte tokenizer)."""
        model = load_cosyvoice2_lm(config)
        if config.checkpoint_dir is None:
            return cls(model, ByteTokenizer(offset=3, bos_id=None))
        directory = resolve_model_ref(config.checkpoint_dir)
        tokenizer = HFTokenizer(directory / QWEN_DIR, extra_special_tokens=TEXT_SPECIAL_TOKENS)
        sampling = published_sampling(cls.default_sampling, read_published_settings(directory))
        return cls(model, tokenizer, sampling)

    def add_voice_prompt(self, prompt: VoicePrompt) -> None:
        self.voice_prompts[prompt.voice_id] = prompt

    def set_default_voice_prompt(self, prompt: VoicePrompt) -> None:
        """The LM prompt of a request naming no voice: `voices.default_clip` with its transcript, as if registered
        with it (the detokenizer's default voice is the same clip, `CodecAdapter.set_default_voice`)."""
        self.default_voice_prompt = prompt

    def format_prompt(self, text: str, voice: str | None) -> list[Token]:
        return self.voice_prompt(text, *self.voice_context(voice))

    def voice_context(self, voice: str | None) -> tuple[str, list[int]]:
        """(transcript, speech tokens) the LM is conditioned on: a registered voice with a transcript
        gives both (CosyVoice's zero-shot mode); without a transcript the LM gets neither (its
        cross-lingual mode) and the voice conditions the detokenizer only. No voice: the default voice's
        prompt where one is set, else neither."""
        if voice is None:
            found = self.default_voice_prompt
            return ("", []) if found is None else (found.prompt_text, list(found.prompt_tokens))
        found = self.voice_prompts.get(voice)
        if found is None:
            raise InvalidArgumentError("voice", f"unknown voice {voice!r}; register it first (POST /v1/voices)")
        return (found.prompt_text, list(found.prompt_tokens)) if found.prompt_text else ("", [])

    def voice_prompt_positions(self, voice: str | None) -> int:
        """The voice's speech tokens and its transcript's positions (zero-shot mode; 0 where the LM gets neither).
        The transcript is estimated as a request's text is: the tokenizer is the engine thread's to call."""
        prompt_text, speech = self.voice_context(voice)
        return self._context_positions(prompt_text, len(speech))

    @classmethod
    def registered_voice_positions(cls, prompt: VoicePrompt) -> int:
        """As the replica counts it (`voice_prompt_positions`): both with a transcript, neither without."""
        return cls._context_positions(prompt.prompt_text, len(prompt.prompt_tokens)) if prompt.prompt_text else 0

    @classmethod
    def _context_positions(cls, prompt_text: str, num_speech_tokens: int) -> int:
        return math.ceil(len(prompt_text) / cls.prompt_chars_per_position) + num_speech_tokens

    def streaming_prompt(self, job: Job) -> tuple[list[Token], TextFeed]:
        """Streamed text (bistream): the prompt is `sos`; the feed lays out the voice's transcript and
        speech tokens and the text in the published 5 : 15 mix (`cosyvoice2_bistream`)."""
        prompt_text, speech = self.voice_context(job.voice)
        check_speech_tokens(speech)
        encode = self.tokenizer.encode
        split = split_whole(encode) if isinstance(self.tokenizer, ByteTokenizer) else split_last_word(encode)
        feed = BistreamFeed.open(split, encode(prompt_text) if prompt_text else [], speech)
        feed.push(job.text)
        return [(SOS, Kind.LLM)], feed

    def voice_prompt(self, text: str, prompt_text: str = "", prompt_speech: list[int] | None = None) -> list[Token]:
        """`[sos, prompt text + text, task_id, prompt speech]`: a zero-shot voice passes its clip's
        transcript and speech tokens; without them this is the plain text-to-speech prompt."""
        speech = list(prompt_speech or [])
        check_speech_tokens(speech)
        body = self.tokenizer.encode(text)
        if not body:
            raise InvalidArgumentError("text", "has no tokens")
        context = self.tokenizer.encode(prompt_text) if prompt_text else []
        return [
            (SOS, Kind.LLM),
            *((i, Kind.PROMPT_TEXT) for i in context),
            *((i, Kind.TEXT) for i in body),
            (TASK_ID, Kind.LLM),
            *((s, Kind.SPEECH) for s in speech),
        ]

    def token_lanes(self, token: Token) -> list[int]:
        return [token, Kind.SPEECH] if isinstance(token, int) else list(token)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T, 2] -> [B, T, H]: each position from the table its kind names."""
        token, kind = ids[..., 0], ids[..., 1]
        is_text = (kind == Kind.TEXT) | (kind == Kind.PROMPT_TEXT)
        text = self.model.qwen.model.embed_tokens(torch.where(is_text, token, 0))
        speech = self.model.speech_embedding(torch.where(kind == Kind.SPEECH, token, 0))
        special = self.model.llm_embedding(torch.where(kind == Kind.LLM, token, 0))
        out = torch.where(is_text.unsqueeze(-1), text, speech)
        return torch.where((kind == Kind.LLM).unsqueeze(-1), special, out)

    def logits(self, hidden: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, None]:
        """hidden [B, H] -> llm_decoder scores [B, 6564] (float32)."""
        decoder = self.model.llm_decoder
        return F.linear(hidden, decoder.weight, decoder.bias).float(), None

    def text_len(self, req: Request) -> int:
        """Text tokens of the request (not a voice's transcript), counted once per request."""
        found = self._text_len.get(req)
        if found is None:
            found = self._text_len[req] = sum(1 for t in req.prompt_ids if isinstance(t, tuple) and t[1] == Kind.TEXT)
        return found

    def length_bounds(self, req: Request) -> tuple[int, int]:
        """(min, max) generated tokens: 2x and 20x the text tokens, as the published loop bounds them.
        Streamed text: no minimum (as published), 20x the text once it has ended (ours: the published
        loop has no bound there)."""
        feed = req.text_feed
        if isinstance(feed, BistreamFeed):
            return 0, MAX_TOKEN_TEXT_RATIO * feed.num_text if feed.is_final else NO_LIMIT
        num_text = self.text_len(req)
        return MIN_TOKEN_TEXT_RATIO * num_text, MAX_TOKEN_TEXT_RATIO * num_text

    def constrain(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Before the minimum length EOS (6561) may not be drawn (the other stop ids may, as published);
        at the maximum only EOS may, so a request ends with exactly the maximum emitted."""
        bounds = [self.length_bounds(r) for r in reqs]
        generated = [len(r.output_ids) for r in reqs]
        below_min = [b for b, (n, (low, _)) in enumerate(zip(generated, bounds, strict=True)) if n < low]
        at_max = [b for b, (n, (_, high)) in enumerate(zip(generated, bounds, strict=True)) if n >= high]
        if below_min:
            logits[below_min, EOS_TOKEN] = float("-inf")
        if at_max:
            logits[at_max] = float("-inf")
            logits[at_max, EOS_TOKEN] = 0.0
        return self.constrain_streaming(logits, reqs)

    def constrain_streaming(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Streamed text, before its end: speech or the fill token is drawn, never a stop id (the
        published loop masks EOS and fails on 6562); every 16th draw is the fill token, forced."""
        feeds = [(b, r.text_feed) for b, r in enumerate(reqs) if isinstance(r.text_feed, BistreamFeed)]
        reading = [(b, feed) for b, feed in feeds if not feed.is_final]
        forced = [b for b, feed in reading if feed.forces_fill]
        speaking = [b for b, feed in reading if not feed.forces_fill]
        if speaking:
            logits[speaking, EOS_TOKEN:FILL_TOKEN] = float("-inf")
        if forced:
            logits[forced] = float("-inf")
            logits[forced, FILL_TOKEN] = 0.0
        return logits

    def is_stop(self, req: Request, token: Token) -> bool:
        """Any of the 3 stop ids ends a request, but the fill token while streamed text is being read."""
        feed = req.text_feed
        return token in STOP_TOKENS and not (isinstance(feed, BistreamFeed) and not feed.is_final)

    def record_token(self, req: Request, token: Token) -> None:
        if isinstance(req.text_feed, BistreamFeed):
            req.text_feed.take_token(req, int(token))  # type: ignore[arg-type]
        else:
            super().record_token(req, token)

    def drawn_ids(self, req: Request, codebook: int) -> list[int]:
        """Streamed text: fill tokens included (the published loop's RAS window counts them too)."""
        feed = req.text_feed
        return feed.drawn if isinstance(feed, BistreamFeed) else super().drawn_ids(req, codebook)

    def is_output(self, req: Request, token: Token) -> bool:
        return not (isinstance(req.text_feed, BistreamFeed) and token == FILL_TOKEN)

    def text_arrived(self, req: Request) -> None:
        if isinstance(req.text_feed, BistreamFeed):
            req.text_feed.lay_out(req)

    def history_ids(self, tokens: list[Token], codebook: int) -> list[int]:
        """Speech ids among `tokens` (a voice's prompt speech and the output); text and sos / task_id
        positions index other tables, so the repetition penalty never sees them."""
        return [t if isinstance(t, int) else t[0] for t in tokens if isinstance(t, int) or t[1] == Kind.SPEECH]

    def new_frame_builder(self) -> SpeechFrameBuilder:
        return SpeechFrameBuilder()


# The S3Gen families' chunk schedule (`detok.schedule: auto`): whole 25-token attention chunks (audio
# leaves per attention chunk), the encoder's 3 look-ahead tokens, and the stream from token 0 on
# every chunk (a cold detok replica rebuilds from it). The first chunk is two attention chunks: its
# audio (100 mel frames less the 28 HiFT holds back = 1.44 s) covers the next chunk's 25 tokens and
# decode, where a 25-token first chunk plays only 0.44 s. Measured on the CPU cluster (2:1, tiny):
# 100% viable streams at 0.25-1 req/s against 81-82% at 0.5-1 req/s, at similar p90 TTFA.
S3GEN_SCHEDULE = whole_stream_schedule(
    2 * STREAM_CHUNK_TOKENS, STREAM_CHUNK_TOKENS, S3GenCodec.min_right_context_frames
)

FAMILY = ModelFamily(
    name="cosyvoice2",
    description="CosyVoice 2 0.5B: the published CosyVoice2-0.5B directory (cosyvoice2.yaml, llm.pt, flow.pt, "
    "hift.pt, CosyVoice-BlankEN/); its S3Gen flow-matching detokenizer comes from the same directory",
    preset_description="CosyVoice 2 layout: small random Qwen2 LM over the 6561-token speech vocabulary + tiny "
    "random S3Gen flow detokenizer (25-token attention chunks)",
    lm=CosyVoice2Adapter,
    codec=S3GenCodec,
    sample_rate_hz=24000,
    frame_rate_hz=25.0,  # one speech token per frame
    repo_id="FunAudioLLM/CosyVoice2-0.5B",
    codec_in_checkpoint=True,  # flow.pt / hift.pt sit beside llm.pt
    checkpoint_marker="cosyvoice2.yaml",  # the directory has no config.json
    chunk_schedule=S3GEN_SCHEDULE,
    streams_text=True,  # bistream: text read while speaking, in the published 5 : 15 mix
)

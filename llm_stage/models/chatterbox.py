"""Chatterbox LM side: T3 (a Llama body over text and 25 Hz S3 speech tokens) on our engine.

A prompt is `[voice, emotion, sot text eot, bos, bos]`: the voice's speaker x-vector and perceiver
rows (computed once per voice: the built-in one at start-up, a registered zero-shot voice when this
replica first looks it up), the emotion-exaggeration row (per request), text ids with learned
text positions, and start-of-speech twice at speech position 0, as the published inference loop
feeds it; generated token i is embedded at speech position i + 1. Positions carry (id, kind, aux)
lanes: aux is the learned position, or the exaggeration's float32 bits. CFG pairs each request with
a twin whose text embeddings are zeroed (positions kept) and merges `cond + g * (cond - uncond)`.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import torch

from core.checkpoints import resolve_model_ref
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import Job, SamplingParams
from core.voices import VoicePrompt
from detok_stage.codecs.s3gen_codec import S3GenCodec
from llm_stage.cfg import GuidanceFormula
from llm_stage.models.base import FrameBuilder, LMAdapter, ModelFamily
from llm_stage.models.chatterbox_t3 import (
    T3,
    T3_FILE,
    TOKENIZER_FILE,
    T3Voice,
    load_published_t3,
    load_published_voice,
    random_voice,
    tiny_t3,
)
from llm_stage.models.cosyvoice2 import S3GEN_SCHEDULE
from llm_stage.models.llama import LlamaBackbone
from llm_stage.models.tokenizers import ByteTokenizer, SpaceMarkedTokenizer, TextTokenizer
from llm_stage.request import Request, Token

DEFAULT_VOICE = "default"  # the voice the published checkpoint ships (conds.pt)


class Kind:
    """Second lane of a position: what its id (first lane) and aux (third lane) mean."""

    VOICE = 0  # id: row of the adapter's voice table
    EMOTION = 1  # aux: the exaggeration as float32 bits
    TEXT = 2  # id: text token, aux: text position
    TEXT_UNCOND = 3  # the CFG twin's text: position only
    SPEECH = 4  # id: speech token, aux: speech position


def float_bits(value: float) -> int:
    """A float32's bits as a signed int32 (exact through an int64 lane and back)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


# ChatterboxTTS' punctuation clean-up before tokenizing: (what, replacement), applied in this order
PUNCTUATION = (
    ("...", ", "), ("\u2026", ", "), (":", ","), (" - ", ", "), (";", ", "), ("\u2014", "-"), ("\u2013", "-"),
    (" ,", ","), ("\u201c", '"'), ("\u201d", '"'), ("\u2018", "'"), ("\u2019", "'"),
)  # fmt: skip
SENTENCE_ENDS = (".", "!", "?", "-", ",")


def normalize_text(text: str) -> str:
    """The text as the published model was trained on it: first letter upper-cased, runs of whitespace as one
    space, uncommon punctuation mapped to common marks, and a full stop when it ends without one."""
    if text[:1].islower():
        text = text[0].upper() + text[1:]
    text = " ".join(text.split())
    for old, new in PUNCTUATION:
        text = text.replace(old, new)
    text = text.rstrip(" ")
    return text if text.endswith(SENTENCE_ENDS) else text + "."


class SpeechFrameBuilder(FrameBuilder):
    """Every generated speech code is one 25 Hz frame; start / stop / unused ids (>= 6561) are no audio."""

    def __init__(self, num_codes: int) -> None:
        self.num_codes = num_codes

    def push(self, token_id: Token) -> list[list[int]]:
        return [[token_id]] if isinstance(token_id, int) and token_id < self.num_codes else []


class ChatterboxAdapter(LMAdapter):
    family = "chatterbox"
    guidance = GuidanceFormula.COND_DELTA
    input_width = 3  # (id, Kind, aux)
    pad_token = (0, Kind.SPEECH, 0)
    default_voice = DEFAULT_VOICE
    voices = (DEFAULT_VOICE,)
    takes_registered_voices = True  # zero-shot: the voice's speaker embedding + prompt tokens (SpeakerPrompt)
    history_ids_per_token = True  # speech ids only, each token on its own
    voice_lm_speaker = True
    voices_alike = True  # every voice: one speaker row, the perceiver's queries, the emotion position
    # ChatterboxTTS.generate's defaults (its T3 loop samples at most 1000 tokens)
    default_sampling = SamplingParams(
        temperature=0.8, top_p=1.0, min_p=0.05, repetition_penalty=1.2, guidance_scale=0.5, exaggeration=0.5,
        max_tokens=1000,
    )  # fmt: skip

    def __init__(self, model: T3, tokenizer: TextTokenizer, voices: dict[str, T3Voice]) -> None:
        shim = SimpleNamespace(config=model.tfmr.config, model=model.tfmr, lm_head=model.speech_head)
        super().__init__(LlamaBackbone(shim))  # type: ignore[arg-type]
        self.model, self.tokenizer, self.layout = model, tokenizer, model.layout
        self.eos_token_ids = frozenset({self.layout.stop_speech})
        self.voices = tuple(voices)
        self.voice_specs = dict(voices)
        self._voice_rows: dict[str, range] = {}
        head = model.speech_head.weight
        self.voice_table = head.new_empty(0, head.shape[1])  # [rows, C]: every voice's rows, built-in ones first
        for name, voice in voices.items():
            self._add_voice(name, voice)
        self.voice_prompts: dict[str, VoicePrompt] = {}  # registered voices this replica has looked up

    @classmethod
    def build(cls, config: ModelConfig) -> ChatterboxAdapter:
        """A published Chatterbox directory (t3_cfg.safetensors, conds.pt, tokenizer.json; a path or a repo
        id in the local HF cache), or the chatterbox-tiny preset: random T3 weights and a random built-in
        voice from `config.seed`, byte tokens."""
        if config.checkpoint_dir is not None:
            directory = resolve_model_ref(config.checkpoint_dir)
            model, voice = load_published_t3(directory), load_published_voice(directory)
            tokenizer: TextTokenizer = SpaceMarkedTokenizer(directory / TOKENIZER_FILE)
        else:
            torch.manual_seed(config.seed)
            model, tokenizer = tiny_t3(), ByteTokenizer(offset=256, bos_id=None)
            voice = random_voice(model.layout)
        model = model.to(config.device, getattr(torch, config.dtype)).eval()
        return cls(model, tokenizer, {DEFAULT_VOICE: voice})

    @torch.no_grad()
    def _add_voice(self, name: str, voice: T3Voice) -> None:
        """Append the voice's rows to the table. The table is rebound, never changed in place: a step
        already reading the old one finds its voices' rows where they were."""
        weight = self.model.cond_enc.spkr_enc.weight
        speaker = voice.speaker_emb.to(weight.device, weight.dtype)
        rows = self.model.voice_rows(speaker, voice.prompt_speech.to(weight.device))
        start = self.voice_table.shape[0]
        self.voice_table = torch.cat([self.voice_table, rows])
        self._voice_rows[name] = range(start, start + rows.shape[0])

    def add_voice_prompt(self, prompt: VoicePrompt) -> None:
        """A registered voice (`LLMVoices.ensure`, once per replica): its rows join the voice table."""
        if prompt.voice_id in self.voice_prompts:
            return
        self._add_voice(prompt.voice_id, self._t3_voice(prompt))
        self.voice_prompts[prompt.voice_id] = prompt

    def voice_prompt_positions(self, voice: str | None) -> int:
        """The voice's conditioning rows (speaker embedding, resampled prompt speech) and the emotion position:
        every T3 prompt starts with them (0 for a voice not looked up here: it is refused at the prompt)."""
        rows = self._voice_rows.get(voice or DEFAULT_VOICE)
        return 0 if rows is None else len(rows) + 1

    def _t3_voice(self, prompt: VoicePrompt) -> T3Voice:
        speaker = prompt.speaker
        if speaker is None or len(speaker.speaker_emb) != self.layout.speaker_embed_size:
            size, want = 0 if speaker is None else len(speaker.speaker_emb), self.layout.speaker_embed_size
            raise InvalidArgumentError(
                "voice", f"{prompt.voice_id} has a {size}-wide speaker embedding; T3 takes {want}"
            )
        bad = next((t for t in speaker.prompt_tokens if not 0 <= t < self.layout.start_speech), None)
        if bad is not None:
            raise InvalidArgumentError("voice", f"prompt speech token {bad} is outside [0, {self.layout.start_speech})")
        tokens = torch.tensor(speaker.prompt_tokens, dtype=torch.long)
        return T3Voice(torch.tensor(speaker.speaker_emb, dtype=torch.float32), tokens)

    def _text_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(normalize_text(text))
        if len(ids) > self.layout.max_text_tokens:
            raise InvalidArgumentError("text", f"is {len(ids)} tokens; T3 takes {self.layout.max_text_tokens}")
        return [self.layout.start_text, *ids, self.layout.stop_text]

    def _prompt(self, text: str, voice: str | None, exaggeration: float, text_kind: int) -> list[Token]:
        rows = self._voice_rows.get(voice or DEFAULT_VOICE)
        if rows is None:
            raise InvalidArgumentError("voice", f"unknown voice {voice!r}; register it first (POST /v1/voices)")
        bos = (self.layout.start_speech, Kind.SPEECH, 0)
        return [
            *((row, Kind.VOICE, 0) for row in rows),
            (0, Kind.EMOTION, float_bits(exaggeration)),
            *((token, text_kind, i) for i, token in enumerate(self._text_ids(text))),
            bos,
            bos,
        ]

    def _exaggeration(self, job: Job) -> float:
        value = job.sampling.exaggeration
        return self.default_sampling.exaggeration if value is None else value  # type: ignore[return-value]

    def format_prompt(self, text: str, voice: str | None) -> list[Token]:
        return self._prompt(text, voice, self.default_sampling.exaggeration or 0.0, Kind.TEXT)

    def unconditional_prompt(self, text: str, voice: str | None) -> list[Token]:
        return self._prompt(text, voice, self.default_sampling.exaggeration or 0.0, Kind.TEXT_UNCOND)

    def job_prompt(self, job: Job) -> list[Token]:
        return self._prompt(job.text, job.voice, self._exaggeration(job), Kind.TEXT)

    def unconditional_job_prompt(self, job: Job) -> list[Token]:
        return self._prompt(job.text, job.voice, self._exaggeration(job), Kind.TEXT_UNCOND)

    def lanes_at(self, req: Request, index: int) -> list[int]:
        """Generated token i sits at speech position i + 1 (the start token took 0)."""
        if index < req.prompt_len:
            return list(req.prompt_ids[index])  # type: ignore[arg-type]
        return [req.token_at(index), Kind.SPEECH, index - req.prompt_len + 1]  # type: ignore[list-item]

    def token_lanes(self, token: Token) -> list[int]:
        return list(token) if isinstance(token, tuple) else [token, Kind.SPEECH, 0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T, 3] -> [B, T, C]: each position from the table its kind names, plus its learned position."""
        token, kind, aux = ids.unbind(-1)
        model = self.model
        is_text = (kind == Kind.TEXT) | (kind == Kind.TEXT_UNCOND)
        is_speech = kind == Kind.SPEECH
        text = model.text_emb(torch.where(kind == Kind.TEXT, token, 0)) * (kind == Kind.TEXT).unsqueeze(-1)
        text = text + model.text_pos_emb.emb(torch.where(is_text, aux, 0))
        speech = model.speech_emb(torch.where(is_speech, token, 0)) + model.speech_pos_emb.emb(
            torch.where(is_speech, aux, 0)
        )
        exaggeration = torch.where(kind == Kind.EMOTION, aux, 0).to(torch.int32).view(torch.float32)
        emotion = exaggeration.to(speech.dtype).unsqueeze(-1) * model.cond_enc.emotion_adv_fc.weight[:, 0]
        voice = self.voice_table[torch.where(kind == Kind.VOICE, token, 0)]
        out = torch.where(is_text.unsqueeze(-1), text, speech)
        out = torch.where((kind == Kind.EMOTION).unsqueeze(-1), emotion, out)
        return torch.where((kind == Kind.VOICE).unsqueeze(-1), voice, out)

    def logits(self, hidden: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, None]:
        return (hidden @ self.model.speech_head.weight.T).float(), None

    def constrain(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The learned speech positions end at max_speech_tokens: a request that reaches it stops there."""
        full = [b for b, r in enumerate(reqs) if len(r.output_ids) >= self.layout.max_speech_tokens]
        if full:
            logits[full] = float("-inf")
            logits[full, self.layout.stop_speech] = 0.0
        return logits

    def history_ids(self, tokens: list[Token], codebook: int) -> list[int]:
        """Speech ids (the start tokens and the output): the published loop penalises exactly these."""
        return [t if isinstance(t, int) else t[0] for t in tokens if isinstance(t, int) or t[1] == Kind.SPEECH]

    def new_frame_builder(self) -> SpeechFrameBuilder:
        return SpeechFrameBuilder(self.layout.start_speech)


FAMILY = ModelFamily(
    name="chatterbox",
    description="Chatterbox: the published ResembleAI/chatterbox directory (t3_cfg.safetensors, s3gen.safetensors, "
    "conds.pt, tokenizer.json); its S3Gen flow-matching detokenizer comes from the same directory",
    preset_description="Chatterbox layout: 2-layer random T3 (width 1024) with a random built-in voice + tiny "
    "random S3Gen flow detokenizer (25-token attention chunks)",
    lm=ChatterboxAdapter,
    codec=S3GenCodec,
    sample_rate_hz=24000,
    frame_rate_hz=25.0,  # one speech token per frame
    repo_id="ResembleAI/chatterbox",
    codec_in_checkpoint=True,  # s3gen.safetensors sits beside t3_cfg.safetensors
    checkpoint_marker=T3_FILE,  # the directory has no config.json
    chunk_schedule=S3GEN_SCHEDULE,
)

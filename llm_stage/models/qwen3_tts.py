"""Qwen3-TTS family LM side (Qwen/Qwen3-TTS-12Hz-*-CustomVoice checkpoints, qwen-tts 0.1.1 semantics).

The talker (a Qwen3 decoder, `qwen3_tts_talker`) runs in the continuous-batching engine on our
slot KV cache and predicts codebook 0 of each 12.5 Hz frame; its code predictor then fills
codebooks 1..K-1 for every row of the batch at once. A position is K codec lanes + one text lane:
its input is the projected text embedding plus the codebook embeddings of the lanes that are set
(prompt positions pair one text id with one talker codec id; a generated frame is its K codes over
the `tts_pad` text). The prompt is the reference's non-streaming CustomVoice layout (the whole text
up front, `talker_prompt`), or for streamed text its streaming layout (`streaming_talker_prompt`):
the prompt ends on the first text id, and each generated frame reads the next text id, then
`tts_eos`, then `tts_pad` (a `TextFeed`, filled as the text arrives). A frame whose codebook 0 is
the codec EOS stops.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import torch

from core.checkpoints import load_or_preset, load_prefixed_state, read_config, resolve_model_ref
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import Job, SamplingParams
from core.transfer import to_device
from detok_stage.codecs.qwen3_tts_codec import Qwen3TTSCodec
from llm_stage.inner_loop import InnerLoop
from llm_stage.models.base import Draws, FrameBuilder, LMAdapter, ModelFamily
from llm_stage.models.llama import LlamaBackbone
from llm_stage.models.qwen3_tts_talker import PredictorRunner, Qwen3TTSModel, TalkerSpec, qwen3_config
from llm_stage.models.tokenizers import ByteTokenizer, HFTokenizer
from llm_stage.request import Request, Token
from llm_stage.text_feed import SplitText, TextFeed, split_last_word, split_whole

FROM_FEED = -2  # a text lane read from the request's `TextFeed` (streamed text)
NONE = -1  # an unset lane: a text-only position's codec lanes, a prompt position's codebooks 1..K-1
NUM_SPECIAL_CODEC_IDS = 1024  # the talker vocab's top ids (specials, speakers, languages): never sampled but EOS
MIN_NEW_FRAMES = 2  # EOS is masked for the first frames, as the reference's min_new_tokens
# CustomVoice's speakers (config.json `talker_config.spk_id`); two speak a dialect (`spk_is_dialect`).
SPEAKERS = ("vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee")
CHAT_TEMPLATE = "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"  # 3 role ids, text, 5 more


def tiny_qwen3_tts_config(num_codebooks: int = 4, codebook_size: int = 64) -> dict[str, Any]:
    """A config.json in the published field names at toy size: talker vocab = codebooks + 1024 specials
    (the published 2048 + 1024), a code predictor narrower than the talker (its input projection on)."""
    specials = {"codec_pad_id": 100, "codec_bos_id": 101, "codec_eos_token_id": 102, "codec_think_id": 103,
                "codec_nothink_id": 104, "codec_think_bos_id": 105, "codec_think_eos_id": 106}  # fmt: skip
    languages = {"english": 110, "chinese": 111, "beijing_dialect": 112, "sichuan_dialect": 113}
    dialects = {"dylan": "beijing_dialect", "eric": "sichuan_dialect"}
    predictor = {
        "vocab_size": codebook_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rope_theta": 1000000,
        "num_code_groups": num_codebooks,
    }  # fmt: skip
    talker = {
        "vocab_size": codebook_size + NUM_SPECIAL_CODEC_IDS, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rope_theta": 1000000, "rope_scaling": {"interleaved": True, "mrope_section": [2, 3, 3]},
        "text_vocab_size": 300, "text_hidden_size": 32, "num_code_groups": num_codebooks, **specials,
        "codec_language_id": languages, "spk_id": {name: 120 + i for i, name in enumerate(SPEAKERS)},
        "spk_is_dialect": {name: dialects.get(name, False) for name in SPEAKERS}, "code_predictor_config": predictor,
    }  # fmt: skip
    return {
        "model_type": "qwen3_tts", "tts_model_type": "custom_voice", "tts_model_size": "tiny", "talker_config": talker,
        "im_start_token_id": 1, "im_end_token_id": 2, "tts_pad_token_id": 3, "tts_bos_token_id": 4,
        "tts_eos_token_id": 5,
    }  # fmt: skip


def load_checkpoint(directory: Path) -> Qwen3TTSModel:
    """config.json + the `talker.*` tensors (single or sharded safetensors), built without a random init."""
    spec = TalkerSpec.from_config(read_config(directory))
    with torch.device("meta"):
        model = Qwen3TTSModel(spec)
    model.talker.load_state_dict(load_prefixed_state(directory, "talker."), strict=True, assign=True)
    for stack in (model.talker.model, model.talker.code_predictor.model):  # RoPE tables are buffers, not weights
        stack.rotary_emb = type(stack.rotary_emb)(stack.config)
    return model


def load_qwen3_tts(config: ModelConfig) -> Qwen3TTSModel:
    model = load_or_preset(
        config.checkpoint_dir,
        load=load_checkpoint,
        preset=lambda: Qwen3TTSModel(TalkerSpec.from_config(tiny_qwen3_tts_config())),
        seed=config.seed,
    )
    return model.to(config.device, getattr(torch, config.dtype)).eval()


class ChatTokenizer(Protocol):
    def chat_ids(self, text: str) -> tuple[list[int], list[int]]:
        """(the 3 role ids `<|im_start|>assistant\\n`, the text's ids)."""
        ...

    def text_splitter(self) -> SplitText:
        """Tokenizes streamed text pieces (ids of the bare text, as `chat_ids` slices them)."""
        ...


class QwenChatTokenizer:
    """The checkpoint's Qwen2 tokenizer over the whole chat string, sliced as the reference slices it."""

    def __init__(self, directory: Path) -> None:
        self.tokenizer = HFTokenizer(directory, add_special_tokens=False)

    def chat_ids(self, text: str) -> tuple[list[int], list[int]]:
        ids = self.tokenizer.encode(CHAT_TEMPLATE.format(text=text))
        return ids[:3], ids[3:-5]

    def text_splitter(self) -> SplitText:
        return split_last_word(self.tokenizer.encode)


class PresetChatTokenizer:
    """The tiny preset's: fixed role ids, UTF-8 bytes at 16.. (its text vocab is 300)."""

    role_ids = (1, 6, 7)

    def chat_ids(self, text: str) -> tuple[list[int], list[int]]:
        return list(self.role_ids), ByteTokenizer(offset=16, bos_id=None).encode(text)

    def text_splitter(self) -> SplitText:
        return split_whole(ByteTokenizer(offset=16, bos_id=None).encode)


class Qwen3TTSFrameBuilder(FrameBuilder):
    """Every generated step is already a whole frame of K codes."""

    def push(self, token_id: Token) -> list[list[int]]:
        return [list(token_id)]  # type: ignore[arg-type]


class Qwen3TTSAdapter(LMAdapter):
    family = "qwen3-tts"
    voices = SPEAKERS
    default_voice = "ryan"
    default_sampling = SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, max_tokens=2048)
    resumes_streamed_text = True  # every generated frame reads the feed's next id

    def __init__(self, model: Qwen3TTSModel, tokenizer: ChatTokenizer) -> None:
        talker, spec = model.talker, model.spec
        shim = SimpleNamespace(config=qwen3_config(spec.talker), model=talker.model, lm_head=talker.codec_head)
        super().__init__(LlamaBackbone(shim))  # type: ignore[arg-type]
        self.model, self.spec, self.tokenizer = model, spec, tokenizer
        self.predictor = PredictorRunner(talker.code_predictor)
        self.num_codebooks = spec.num_codebooks
        codes = self.predictor.static_codes(talker.model.codec_embedding)
        self.inner_loop = InnerLoop(codes, self.num_codebooks, "qwen3-tts code predictor")  # a CUDA graph per size
        self.input_width = self.num_codebooks + 1
        self.pad_token = (NONE,) * self.input_width
        fields = spec.talker
        self.eos_code = fields["codec_eos_token_id"]
        self.speaker_ids = {k.lower(): v for k, v in (fields.get("spk_id") or {}).items()}
        self.dialects = {k.lower(): v for k, v in (fields.get("spk_is_dialect") or {}).items()}
        self.language_ids = {k.lower(): v for k, v in (fields.get("codec_language_id") or {}).items()}
        vocab = fields["vocab_size"]
        suppressed = torch.zeros(vocab, dtype=torch.bool)
        suppressed[max(0, vocab - NUM_SPECIAL_CODEC_IDS) :] = True
        suppressed[self.eos_code] = False
        self.suppressed = suppressed.to(talker.codec_head.weight.device)

    @classmethod
    def build(cls, config: ModelConfig) -> Qwen3TTSAdapter:
        model = load_qwen3_tts(config)
        if config.checkpoint_dir is not None:
            return cls(model, QwenChatTokenizer(resolve_model_ref(config.checkpoint_dir)))
        return cls(model, PresetChatTokenizer())

    def position(self, codec: int = NONE, text: int = NONE) -> tuple[int, ...]:
        """A prompt position: one talker codec id (or none) over one text id (or none)."""
        return (codec,) + (NONE,) * (self.num_codebooks - 1) + (text,)

    def codec_prefix(self, voice: str | None, language: str = "auto") -> list[int]:
        """The codec ids the prompt starts with: think tags (with the language, a dialect speaker's own
        under `auto`), the speaker, then `codec_pad` (the reference's codec ids but its final `codec_bos`)."""
        f = self.spec.talker
        speaker = None
        if voice:
            if voice.lower() not in self.speaker_ids:
                raise InvalidArgumentError("voice", f"this checkpoint has no speaker {voice!r}")
            speaker = self.speaker_ids[voice.lower()]
            speaker = speaker[0] if isinstance(speaker, list) else speaker
        language_id = None if language == "auto" else self.language_ids[language]
        dialect = self.dialects.get(voice.lower()) if voice else None
        if language in ("auto", "chinese") and dialect:
            language_id = self.language_ids[dialect]
        think = [f["codec_nothink_id"], f["codec_think_bos_id"], f["codec_think_eos_id"]]
        if language_id is not None:
            think = [f["codec_think_id"], f["codec_think_bos_id"], language_id, f["codec_think_eos_id"]]
        return think + ([speaker] if speaker is not None else []) + [f["codec_pad_id"]]

    def talker_prompt(self, role_ids: list[int], text_ids: list[int], codec_prefix: list[int]) -> list[Token]:
        """Non-streaming text: the role text-only; the codec prefix over `tts_pad` (its last id over
        `tts_bos`); every text id, then `tts_eos`, over `codec_pad`; `tts_pad` over `codec_bos`."""
        spec, f, at = self.spec, self.spec.talker, self.position
        texts = [spec.tts_pad_id] * (len(codec_prefix) - 1) + [spec.tts_bos_id]
        return [
            *(at(text=t) for t in role_ids),
            *(at(codec, text) for codec, text in zip(codec_prefix, texts, strict=True)),
            *(at(f["codec_pad_id"], t) for t in [*text_ids, spec.tts_eos_id]),
            at(f["codec_bos_id"], spec.tts_pad_id),
        ]

    def streaming_talker_prompt(self, role_ids: list[int], codec_prefix: list[int]) -> list[Token]:
        """Streamed text: the non-streaming layout up to the codec prefix, then `codec_bos` over the
        first text id (read from the feed, as every generated frame's text lane after it)."""
        prompt = self.talker_prompt(role_ids, [], codec_prefix)[: len(role_ids) + len(codec_prefix)]
        return [*prompt, self.position(self.spec.talker["codec_bos_id"], FROM_FEED)]

    def streaming_prompt(self, job: Job) -> tuple[list[Token], TextFeed]:
        role_ids, _ = self.tokenizer.chat_ids(job.text)
        prompt = self.streaming_talker_prompt(role_ids, self.codec_prefix(job.voice))
        feed = TextFeed(self.tokenizer.text_splitter(), (self.spec.tts_eos_id,), self.spec.tts_pad_id, len(prompt) - 1)
        feed.push(job.text)
        return prompt, feed

    def lanes_at(self, req: Request, index: int) -> list[int]:
        lanes = self.token_lanes(req.token_at(index))
        feed = req.text_feed
        if feed is not None and index >= feed.first_position:
            lanes[-1] = feed.at(index - feed.first_position)
        return lanes

    def format_prompt(self, text: str, voice: str | None) -> list[Token]:
        role_ids, text_ids = self.tokenizer.chat_ids(text)
        return self.talker_prompt(role_ids, text_ids, self.codec_prefix(voice))

    def token_lanes(self, token: Token) -> list[int]:
        lanes = list(token)  # type: ignore[arg-type]
        return lanes if len(lanes) == self.input_width else [*lanes, self.spec.tts_pad_id]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T, K + 1] -> projected text embedding + the set codec lanes' embeddings [B, T, H]."""
        talker = self.model.talker
        text_ids = ids[..., -1]
        text = talker.text_projection(talker.model.text_embedding(text_ids.clamp(min=0)))
        out = text.masked_fill((text_ids < 0).unsqueeze(-1), 0.0)
        for codebook in range(self.num_codebooks):
            codes = ids[..., codebook]
            safe = codes.clamp(min=0)
            first = codebook == 0
            vectors = talker.model.codec_embedding(safe) if first else self.predictor.embed_codes(safe, codebook)
            out = out + vectors.masked_fill((codes < 0).unsqueeze(-1), 0.0)
        return out

    def is_stop(self, req: Request, token: Token) -> bool:
        return token[0] == self.eos_code  # type: ignore[index]

    def penalty_history(self, req: Request, codebook: int) -> list[int]:
        """Codebook 0 over its generated ids (the reference penalises the talker's own output only);
        the code predictor's draws are not penalised."""
        if codebook != 0:
            return []
        window = req.sampling.repetition_window
        frames = req.output_ids[-window:] if window else req.output_ids
        return [frame[0] for frame in frames]  # type: ignore[index]

    def constrain(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Special codec ids never (but EOS); EOS not before the `MIN_NEW_FRAMES`th frame."""
        logits = logits.masked_fill(self.suppressed.to(logits.device), float("-inf"))
        early = [len(req.output_ids) < MIN_NEW_FRAMES for req in reqs]
        if any(early):  # the rows as a mask copied without waiting (a list index is a blocking upload)
            rows = to_device(torch.tensor(early), logits.device)
            logits[: len(early), self.eos_code].masked_fill_(rows, float("-inf"))
        return logits

    def sample_tokens(
        self, hidden: torch.Tensor, logits: torch.Tensor, cand: torch.Tensor | None, reqs: list[Request], draw: Draws
    ) -> list[Token]:
        """Codebook 0 from the talker logits, then the code predictor's K-1 batched steps: chained on the
        device and read back once (`llm_stage.inner_loop`), or drawn per codebook on the host."""
        logits = self.constrain(logits.float(), reqs)
        if not draw.chains_on_device(reqs):
            return self._sample_on_host(hidden, logits, cand, reqs, draw)
        first = draw.on_device(logits, cand, reqs, [0] * len(reqs))  # [B]
        embedding = self.model.talker.model.codec_embedding
        eager = lambda row_draw: self.predictor.codes_on_device(hidden, first, embedding, row_draw)  # noqa: E731
        return self.inner_loop.frame(draw, reqs, hidden, first, eager)

    def _sample_on_host(
        self, hidden: torch.Tensor, logits: torch.Tensor, cand: torch.Tensor | None, reqs: list[Request], draw: Draws
    ) -> list[Token]:
        """Each codebook's ids read back and uploaded again (CPU: numpy draws; repetition-aware rows)."""
        first = draw(logits, cand, reqs, [0] * len(reqs))
        rest = self.predictor.predict(
            hidden,
            torch.tensor(first, device=hidden.device),
            self.model.talker.model.codec_embedding,
            lambda codebook_logits, k: draw(codebook_logits, None, reqs, [k] * len(reqs)),
        )
        return [tuple(frame) for frame in zip(first, *rest, strict=True)]

    def new_frame_builder(self) -> Qwen3TTSFrameBuilder:
        return Qwen3TTSFrameBuilder()


FAMILY = ModelFamily(
    name="qwen3-tts",
    description="Qwen3-TTS 12 Hz CustomVoice: config.json + safetensors (talker, code predictor), Qwen2 tokenizer; "
    "its speech_tokenizer/ decoder (or --codec Qwen/Qwen3-TTS-Tokenizer-12Hz)",
    preset_description="Qwen3-TTS layout: Qwen3 talker + code predictor over 4 codebooks, small causal 12.5 Hz "
    "tokenizer decoder, random tiny weights",
    lm=Qwen3TTSAdapter,
    codec=Qwen3TTSCodec,
    sample_rate_hz=24000,
    frame_rate_hz=12.5,
    repo_id="Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice",
    codec_in_checkpoint=True,
    is_checkpoint=lambda config: config.get("model_type") == "qwen3_tts",
    streams_text=True,
)

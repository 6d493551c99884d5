"""Dia family LM side (Nari Labs Dia on transformers' `DiaForConditionalGeneration` weights).

A byte-level text encoder conditions a decoder that predicts K DAC channels per step under
Dia's delay pattern ([0, 8..15] for the 1.6B model). The decoder runs in the continuous-batching
engine (`dia_decoder.DiaDecoderBackbone`); CFG pairs each request with an all-zero-text twin and
merges `cond + g * (cond - uncond)` (top-k of that over cond); only channel 0 may emit EOS, which
then cascades through the other channels by their delays. Frames go to a DAC detokenizer.
"""

from __future__ import annotations

import torch
from transformers import DiaConfig, DiaForConditionalGeneration

from core.checkpoints import hf_loader, load_or_preset
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from detok_stage.codecs.dac_codec import DacCodec
from llm_stage.cfg import GuidanceFormula
from llm_stage.delay_pattern import DelayPattern, StreamingDeinterleaver
from llm_stage.models.base import FrameBuilder, LMAdapter, ModelFamily
from llm_stage.models.delay_rules import apply_forced, check_stream0_leads, eos_step, forced_ids
from llm_stage.models.dia_decoder import NO_TEXT, START, DiaDecoderBackbone
from llm_stage.request import Request, Token

SPEAKER_TAGS = {"[S1]": 1, "[S2]": 2}  # DiaTokenizer's added tokens; other text is raw UTF-8 bytes
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def tiny_dia_config(codebook_size: int = 64, delays: tuple[int, ...] = (0, 3, 4, 5)) -> DiaConfig:
    """Dia's layout at toy size: byte encoder, K = len(delays) channels, vocab = codes + EOS/PAD/BOS/spare."""
    encoder = {
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256, "max_position_embeddings": 512,
        "rope_parameters": _ROPE,
    }  # fmt: skip
    decoder = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "cross_num_attention_heads": 4, "cross_num_key_value_heads": 2,
        "cross_head_dim": 8, "cross_hidden_size": 16, "vocab_size": codebook_size + 4, "num_channels": len(delays),
        "eos_token_id": codebook_size, "pad_token_id": codebook_size + 1, "bos_token_id": codebook_size + 2,
        "max_position_embeddings": 4096, "rope_parameters": _ROPE,
    }  # fmt: skip
    return DiaConfig(encoder_config=encoder, decoder_config=decoder, delay_pattern=list(delays))


def load_dia(config: ModelConfig) -> DiaForConditionalGeneration:
    """nari-labs/Dia-1.6B-0626 (a repo id in the local HF cache, or a dir) or the tiny random preset."""
    model = load_or_preset(
        config.checkpoint_dir, load=hf_loader(DiaForConditionalGeneration), preset=_dia_preset, seed=config.seed
    )
    return model.to(config.device, getattr(torch, config.dtype)).eval()


def _dia_preset() -> DiaForConditionalGeneration:
    model = DiaForConditionalGeneration(tiny_dia_config())
    with torch.no_grad():  # wider than HF's init so greedy picks are not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model


def encode_dia_text(text: str) -> list[int]:
    """DiaTokenizer's ids: `[S1]` / `[S2]` -> 1 / 2, everything else its UTF-8 bytes."""
    ids: list[int] = []
    rest = text
    while rest:
        tag = next((t for t in SPEAKER_TAGS if rest.startswith(t)), None)
        if tag is not None:
            ids.append(SPEAKER_TAGS[tag])
            rest = rest[len(tag) :]
        else:
            ids.extend(rest[0].encode("utf-8"))
            rest = rest[1:]
    return ids


def last_speaker_tag(texts: tuple[str, ...], default: str = "[S1]") -> str:
    """The speaker tag that ends up speaking after `texts` (the last one named), else `default`."""
    for text in reversed(texts):
        found = [(text.rfind(tag), tag) for tag in SPEAKER_TAGS if tag in text]
        if found:
            return max(found)[1]
    return default


class DiaFrameBuilder(FrameBuilder):
    """De-interleaves delayed steps; frames holding EOS / PAD / BOS are not audio."""

    def __init__(self, pattern: DelayPattern, codebook_size: int) -> None:
        self.stream = StreamingDeinterleaver(pattern)
        self.codebook_size = codebook_size

    def push(self, token_id: Token) -> list[list[int]]:
        frames = self.stream.push(list(token_id))  # type: ignore[arg-type]
        return [f for f in frames if max(f) < self.codebook_size]


class DiaAdapter(LMAdapter):
    family = "dia"
    guidance = GuidanceFormula.DIA
    # Dia's published generation config: CFG 3.0, temperature 1.8, top-p 0.9, top-k 45.
    default_sampling = SamplingParams(temperature=1.8, top_p=0.9, top_k=45, guidance_scale=3.0, max_tokens=3072)

    def __init__(self, model: DiaForConditionalGeneration) -> None:
        super().__init__(DiaDecoderBackbone(model))  # type: ignore[arg-type]
        dec = model.config.decoder_config
        self.model = model
        self.pattern = DelayPattern(tuple(model.config.delay_pattern), dec.bos_token_id, dec.pad_token_id)
        check_stream0_leads(self.pattern)
        if self.pattern.delays.count(self.pattern.delays[0]) > 1:
            raise ValueError(f"only channel 0 may have the smallest delay: {self.pattern.delays}")
        self.eos_id, self.vocab_size = dec.eos_token_id, dec.vocab_size
        self.num_codebooks = dec.num_channels
        self.input_width = dec.num_channels + 1
        self.pad_token = (dec.pad_token_id,) * dec.num_channels + (NO_TEXT,)
        self.max_text_tokens = min(model.config.encoder_config.max_position_embeddings, self.max_text_chars)
        self._tail = self.pattern.max_delay - self.pattern.delays[0]  # steps after channel 0's EOS

    @classmethod
    def build(cls, config: ModelConfig) -> DiaAdapter:
        return cls(load_dia(config))

    def _text_ids(self, text: str) -> list[int]:
        ids = encode_dia_text(text)
        if len(ids) > self.max_text_tokens:
            raise InvalidArgumentError("text", f"is {len(ids)} tokens; Dia's encoder takes {self.max_text_tokens}")
        return ids

    def _prompt(self, text_ids: list[int]) -> list[Token]:
        """Text positions (PAD audio lanes), then START: all-BOS audio lanes that trigger the encoder."""
        pad, bos = self.pattern.pad_id, self.pattern.bos_id
        body: list[Token] = [(pad,) * self.num_codebooks + (i,) for i in text_ids]
        return [*body, (bos,) * self.num_codebooks + (START,)]

    def format_prompt(self, text: str, voice: str | None) -> list[Token]:
        return self._prompt(self._text_ids(text))

    @classmethod
    def continue_text(cls, text: str, previous: tuple[str, ...]) -> str:
        """A segment that names no speaker first is spoken by the last one named before it (Dia
        reads untagged text as a new, random speaker)."""
        if text.lstrip().startswith(tuple(SPEAKER_TAGS)):
            return text
        return f"{last_speaker_tag(previous)} {text.lstrip()}"

    def unconditional_prompt(self, text: str, voice: str | None) -> list[Token]:
        """Dia's unconditional input: an all-zero text of the same length."""
        return self._prompt([0] * len(self._text_ids(text)))

    def token_lanes(self, token: Token) -> list[int]:
        lanes = list(token)  # type: ignore[arg-type]
        return lanes if len(lanes) == self.input_width else [*lanes, NO_TEXT]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embed(ids)

    def logits(self, hidden: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, None]:
        """hidden [B, H] -> [B, K, V]."""
        out = self.model.logits_dense(hidden)
        return out.view(hidden.shape[0], self.num_codebooks, self.vocab_size).float(), None

    def constrain(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Dia's rules on the CFG-merged logits: temperature floor, EOS channel filter, delay forcing."""
        logits = self._temperature_floor(logits, reqs)
        logits = self._eos_channel_filter(logits)
        forced = [forced_ids(self.pattern, len(r.output_ids), self._end_step(r), self.eos_id) for r in reqs]
        return apply_forced(logits, forced)

    @staticmethod
    def _temperature_floor(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Dia samples with temperature >= 1: a row with 0 < T < 1 is pre-scaled so the sampler's /T acts as /1."""
        for b, req in enumerate(reqs):
            temperature = req.sampling.temperature
            if 0.0 < temperature < 1.0:
                logits[b] *= temperature
        return logits

    def _eos_channel_filter(self, logits: torch.Tensor) -> torch.Tensor:
        """Only channel 0 may pick EOS, and only when EOS is its argmax; ids above EOS never sampled."""
        logits[:, 1:, self.eos_id :] = float("-inf")
        logits[:, 0, self.eos_id + 1 :] = float("-inf")
        first = logits[:, 0]  # [B, V] view
        is_eos_top = first.argmax(dim=-1) == self.eos_id
        first[is_eos_top, : self.eos_id] = float("-inf")
        first[~is_eos_top, self.eos_id] = float("-inf")
        return logits

    def _end_step(self, req: Request) -> int | None:
        """Channel 0's EOS step; at the length limit the cascade starts so the last frames complete."""
        found = eos_step(req, self.eos_id, self._tail + 1)
        limit = req.sampling.max_tokens - self._tail - 1
        return found if found is not None or len(req.output_ids) < limit else min(limit, len(req.output_ids))

    def is_stop(self, req: Request, token: Token) -> bool:
        """The step where the last channel takes its EOS ends the request (that step is not emitted)."""
        step = len(req.output_ids)
        end = eos_step(req, self.eos_id, self._tail + 1)
        if end is None and token[0] == self.eos_id:  # type: ignore[index]
            end = step
        return end is not None and step >= end + self._tail

    def new_frame_builder(self) -> DiaFrameBuilder:
        return DiaFrameBuilder(self.pattern, self.eos_id)


FAMILY = ModelFamily(
    name="dia",
    description="Nari Labs Dia 1.6B: DiaForConditionalGeneration checkpoint (safetensors) + DAC 44.1 kHz (DacModel)",
    preset_description="Dia layout: byte text encoder + decoder over 4 delayed DAC channels, CFG, random tiny weights",
    lm=DiaAdapter,
    codec=DacCodec,
    sample_rate_hz=44100,
    frame_rate_hz=44100 / 512,
    repo_id="nari-labs/Dia-1.6B-0626",
    codec_repo_id="descript/dac_44khz",
    is_checkpoint=lambda config: config.get("model_type") == "dia",
)

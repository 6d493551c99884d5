"""Orpheus family LM side: Llama backbone, Orpheus prompt framing and voices, SNAC token layout.

A frame is 7 tokens over 3 SNAC levels; token id = 128266 + (k % 7) * 4096 + code. Sampling is
restricted per frame slot: slot k % 7 may only emit its own 4096-code range, plus end-of-speech
(128258) at frame boundaries, so every frame decodes. The logits head computes only those
candidate columns (a contiguous slice of lm_head), which is the hot-path saving on 157k vocabs.
"""

from __future__ import annotations

from functools import cached_property

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.checkpoints import hf_loader, load_or_preset, resolve_model_ref
from core.config import ModelConfig
from core.messages import SamplingParams
from core.transfer import to_device
from detok_stage.codecs.snac_codec import SnacCodec
from llm_stage.models.base import FrameBuilder, LMAdapter, ModelFamily
from llm_stage.models.llama import LlamaBackbone
from llm_stage.models.tokenizers import ByteTokenizer, HFTokenizer, TextTokenizer
from llm_stage.request import Request

AUDIO_TOKEN_BASE = 128266
CODES_PER_SLOT = 4096
TOKENS_PER_FRAME = 7
END_OF_SPEECH = 128258
START_OF_HUMAN = 128259
END_OF_TEXT = 128009
END_OF_HUMAN = 128260
START_OF_AI = 128261
START_OF_SPEECH = 128257
VOCAB_SIZE = 156940
SMALL_GROUP = 3  # rows of one frame slot up to which the transposed slot head is the faster product
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")


def tiny_llama_config(max_positions: int = 4096) -> LlamaConfig:
    """The orpheus-tiny backbone: Orpheus vocab and layout, small Llama body."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=END_OF_SPEECH,
    )


def build_llama(config: ModelConfig, preset: LlamaConfig) -> LlamaForCausalLM:
    """Load a local HF checkpoint, or build the preset with random weights from `config.seed`."""
    dtype = getattr(torch, config.dtype)
    model = load_or_preset(
        config.checkpoint_dir,
        load=hf_loader(LlamaForCausalLM, dtype=dtype),
        preset=lambda: LlamaForCausalLM(preset).to(dtype),
        seed=config.seed,
    )
    return model.to(config.device).eval()


def slot_of(num_generated: int) -> int:
    return num_generated % TOKENS_PER_FRAME


def code_of(token_id: int, slot: int) -> int:
    return token_id - AUDIO_TOKEN_BASE - slot * CODES_PER_SLOT


class OrpheusFrameBuilder(FrameBuilder):
    def __init__(self) -> None:
        self._codes: list[int] = []

    def push(self, token_id: int) -> list[list[int]]:
        self._codes.append(code_of(token_id, len(self._codes)))
        if len(self._codes) < TOKENS_PER_FRAME:
            return []
        frame, self._codes = self._codes, []
        return [frame]


class OrpheusAdapter(LMAdapter):
    family = "orpheus"
    tokens_per_frame = TOKENS_PER_FRAME
    head_phase_period = TOKENS_PER_FRAME  # one slot head per position in the frame
    voices = VOICES
    default_voice = "tara"
    eos_token_ids = frozenset({END_OF_SPEECH})
    default_sampling = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=1200)

    def __init__(self, backbone: LlamaBackbone, tokenizer: TextTokenizer) -> None:
        super().__init__(backbone)
        self.tokenizer = tokenizer

    @classmethod
    def build(cls, config: ModelConfig) -> OrpheusAdapter:
        model = build_llama(config, tiny_llama_config())
        has_checkpoint = config.checkpoint_dir is not None
        tokenizer = HFTokenizer(resolve_model_ref(config.checkpoint_dir)) if has_checkpoint else ByteTokenizer()
        return cls(LlamaBackbone(model), tokenizer)

    @cached_property
    def slot_heads(self) -> torch.Tensor:
        return slot_heads(self.backbone.lm_head_weight)

    def format_prompt(self, text: str, voice: str | None) -> list[int]:
        body = self.tokenizer.encode(f"{voice}: {text}" if voice else text)
        return [START_OF_HUMAN, *body, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]

    def logits(self, hidden: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: the 4096 codes of its frame slot, plus an end-of-speech column (-inf off-boundary).
        Row indices go to the device in non-blocking copies (no host wait on a GPU)."""
        device = hidden.device
        out = torch.empty(hidden.shape[0], CODES_PER_SLOT + 1, dtype=torch.float32, device=device)
        num_generated = [len(r.output_ids) for r in reqs]
        slots = [slot_of(n) for n in num_generated]
        phases = sorted(set(slots))
        if len(phases) == 1:  # aligned rows (the usual case): views and a plain copy, no gather / index_put
            out[:, :CODES_PER_SLOT] = self._slot_logits(hidden, phases[0])  # copies into fp32
            candidates = self._candidates(device)[phases[0]].expand(len(reqs), -1)
        else:
            for slot in phases:
                index = _index([b for b, s in enumerate(slots) if s == slot], device)
                out[index, :CODES_PER_SLOT] = self._slot_logits(hidden[index], slot)
            candidates = self._candidates(device)[_index(slots, device)]
        end_of_speech = (hidden @ self.backbone.lm_head_weight[END_OF_SPEECH]).float()
        off_boundary = [n == 0 or slot_of(n) != 0 for n in num_generated]
        if any(off_boundary):
            end_of_speech = end_of_speech.masked_fill(_index(off_boundary, device, torch.bool), float("-inf"))
        out[:, CODES_PER_SLOT] = end_of_speech
        return out, candidates

    def _slot_logits(self, hidden: torch.Tensor, slot: int) -> torch.Tensor:
        """[R, 4096] for R rows on one frame slot: up to SMALL_GROUP rows multiply the slot's
        transposed copy (MKL's fastest form for a few rows), more multiply lm_head's own rows as
        W @ h^T (faster once the rows amortise reading the weight)."""
        if hidden.shape[0] <= SMALL_GROUP:
            return hidden @ self.slot_heads[slot]
        start = AUDIO_TOKEN_BASE + slot * CODES_PER_SLOT
        return (self.backbone.lm_head_weight[start : start + CODES_PER_SLOT] @ hidden.T).T

    def _candidates(self, device: torch.device) -> torch.Tensor:
        """[7, 4097] vocab id of every column, per frame slot (built once)."""
        if getattr(self, "_cand_table", None) is None or self._cand_table.device != device:
            self._cand_table = candidate_table(device)
        return self._cand_table

    def new_frame_builder(self) -> OrpheusFrameBuilder:
        return OrpheusFrameBuilder()


def _index(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def slot_heads(lm_head_weight: torch.Tensor) -> torch.Tensor:
    """[7, H, 4096]: each frame slot's rows of lm_head, transposed and contiguous (a copy).

    Used for small groups of rows on one slot (see `OrpheusAdapter._slot_logits`). Costs
    7 x 4096 x H more weights (28 MB at H=256, 176 MB for Orpheus 3B in bf16).
    """
    audio = lm_head_weight[AUDIO_TOKEN_BASE : AUDIO_TOKEN_BASE + TOKENS_PER_FRAME * CODES_PER_SLOT]
    return audio.detach().reshape(TOKENS_PER_FRAME, CODES_PER_SLOT, -1).transpose(1, 2).contiguous()


def candidate_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """[7, 4097]: per frame slot, the vocab id of each logits column (its 4096 codes, then end-of-speech)."""
    starts = AUDIO_TOKEN_BASE + torch.arange(TOKENS_PER_FRAME, device=device) * CODES_PER_SLOT
    codes = starts.unsqueeze(1) + torch.arange(CODES_PER_SLOT, device=device)
    eos = torch.full((TOKENS_PER_FRAME, 1), END_OF_SPEECH, device=device)
    return torch.cat([codes, eos], dim=1)


def allowed_token_ids(num_generated: int) -> list[int]:
    """The ids a request may emit after `num_generated` tokens (reference for tests and baselines)."""
    slot = slot_of(num_generated)
    start = AUDIO_TOKEN_BASE + slot * CODES_PER_SLOT
    ids = list(range(start, start + CODES_PER_SLOT))
    if num_generated > 0 and slot == 0:
        ids.append(END_OF_SPEECH)
    return ids


def is_orpheus_checkpoint(config: dict) -> bool:
    """A Llama checkpoint whose vocab holds Orpheus' 7 x 4096 audio tokens."""
    return config.get("model_type") == "llama" and config.get("vocab_size", 0) >= AUDIO_TOKEN_BASE + 7 * CODES_PER_SLOT


FAMILY = ModelFamily(
    name="orpheus",
    description="Orpheus 3B: LlamaForCausalLM checkpoint (sharded safetensors + tokenizer) + SNAC 24 kHz "
    "(config.json + pytorch_model.bin)",
    preset_description="Orpheus layout, small random-weight Llama + small SNAC (built in code)",
    lm=OrpheusAdapter,
    codec=SnacCodec,
    sample_rate_hz=24000,
    frame_rate_hz=24000 / 2048,
    repo_id="canopylabs/orpheus-3b-0.1-ft",
    codec_repo_id="hubertsiuzdak/snac_24khz",
    is_checkpoint=is_orpheus_checkpoint,
)

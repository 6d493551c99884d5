"""CSM family LM side (Sesame CSM on transformers' `CsmForConditionalGeneration` weights).

The Llama-style backbone runs in the continuous-batching engine on our slot KV cache and
predicts codebook 0 of each Mimi frame; the depth decoder then fills codebooks 1..K-1 for
every row of the batch at once, with a small cache that lives for one frame only. Positions
are K audio lanes + one text lane: text positions embed the text id, audio positions the
sum of their K codebook embeddings. A frame whose codebooks 0..K-2 are all EOS stops.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import CsmConfig, CsmForConditionalGeneration, DynamicCache

from core.checkpoints import hf_loader, load_or_preset
from core.config import ModelConfig
from core.messages import SamplingParams
from detok_stage.codecs.mimi_codec import MimiCodec, tiny_mimi_config
from llm_stage.models.base import DrawFn, FrameBuilder, LMAdapter, ModelFamily
from llm_stage.models.llama import LlamaBackbone
from llm_stage.models.tokenizers import ByteTokenizer, HFTokenizer, TextTokenizer
from llm_stage.request import Request, Token

NO_TEXT = -1  # text lane of an audio position


def tiny_csm_config(num_codebooks: int = 8) -> CsmConfig:
    depth = {
        "num_codebooks": num_codebooks, "backbone_hidden_size": 64, "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": num_codebooks + 1,
    }  # fmt: skip
    return CsmConfig(
        num_codebooks=num_codebooks, vocab_size=64, text_vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, pad_token_id=2, eos_token_id=3, audio_token_id=510, audio_eos_token_id=511,
        codebook_pad_token_id=63, codebook_eos_token_id=0, depth_decoder_config=depth,
        codec_config=tiny_mimi_config(num_codebooks), rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip


def load_csm(config: ModelConfig) -> CsmForConditionalGeneration:
    """Local HF checkpoint (e.g. sesame/csm-1b downloaded beforehand) or the tiny random preset."""
    model = load_or_preset(
        config.checkpoint_dir,
        load=hf_loader(CsmForConditionalGeneration),
        preset=lambda: CsmForConditionalGeneration(tiny_csm_config()),
        seed=config.seed,
    )
    return model.to(config.device, getattr(torch, config.dtype)).eval()


class CsmFrameBuilder(FrameBuilder):
    """Every generated step is already a whole frame of K codes."""

    def push(self, token_id: Token) -> list[list[int]]:
        return [list(token_id)]  # type: ignore[arg-type]


class CsmAdapter(LMAdapter):
    family = "csm"
    voices = tuple(str(i) for i in range(10))  # CSM speaker ids
    default_voice = "0"
    default_sampling = SamplingParams(temperature=0.9, top_k=50, max_tokens=375)

    def __init__(self, model: CsmForConditionalGeneration, tokenizer: TextTokenizer) -> None:
        shim = SimpleNamespace(config=model.config, model=model.backbone_model, lm_head=model.lm_head)
        super().__init__(LlamaBackbone(shim))  # type: ignore[arg-type]
        self.model, self.tokenizer = model, tokenizer
        self.num_codebooks = model.config.num_codebooks
        self.input_width = self.num_codebooks + 1
        self.pad_token = (0,) * self.num_codebooks + (model.config.pad_token_id,)
        self.eos_code = model.config.codebook_eos_token_id

    @classmethod
    def build(cls, config: ModelConfig) -> CsmAdapter:
        model = load_csm(config)
        if config.checkpoint_dir is not None:
            return cls(model, HFTokenizer(Path(config.checkpoint_dir)))
        return cls(model, ByteTokenizer(offset=4, bos_id=model.config.bos_token_id))

    def format_prompt(self, text: str, voice: str | None) -> list[Token]:
        """CSM's text turn `[speaker]text`; generation continues with audio frames."""
        return [(0,) * self.num_codebooks + (i,) for i in self.tokenizer.encode(f"[{voice}]{text}")]

    def token_lanes(self, token: Token) -> list[int]:
        lanes = list(token)  # type: ignore[arg-type]
        return lanes if len(lanes) == self.input_width else [*lanes, NO_TEXT]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T, K + 1] -> text embedding on text positions, summed codebook embeddings elsewhere."""
        text_ids = ids[..., -1]
        is_text = (text_ids != NO_TEXT).unsqueeze(-1)
        text = self.model.embed_text_tokens(text_ids.clamp(min=0))
        audio = self.model.backbone_model.embed_tokens(ids[..., :-1])
        return torch.where(is_text, text, audio)

    def is_stop(self, req: Request, token: Token) -> bool:
        return all(code == self.eos_code for code in token[: self.num_codebooks - 1])  # type: ignore[index]

    def sample_tokens(
        self, hidden: torch.Tensor, logits: torch.Tensor, cand: torch.Tensor | None, reqs: list[Request], draw: DrawFn
    ) -> list[Token]:
        """Codebook 0 from the backbone logits, then K-1 batched depth-decoder steps."""
        codes = [draw(logits, None, reqs, [0] * len(reqs))]  # [k][B]
        depth = self.model.depth_decoder
        cache = DynamicCache(config=depth.config)
        first = torch.tensor(codes[0], device=hidden.device).unsqueeze(1)
        step_ids = torch.nn.functional.pad(first, (1, 0))  # [B, 2]: backbone-state slot, codebook 0
        state: torch.Tensor | None = hidden
        for k in range(1, self.num_codebooks):
            out = depth(
                input_ids=step_ids, backbone_last_hidden_state=state, cache=cache, use_cache=True, logits_to_keep=1
            )
            codes.append(draw(out.logits[:, -1].float(), None, reqs, [k] * len(reqs)))
            step_ids, state = torch.tensor(codes[-1], device=hidden.device).unsqueeze(1), None
        return [tuple(column) for column in zip(*codes, strict=True)]

    def new_frame_builder(self) -> CsmFrameBuilder:
        return CsmFrameBuilder()


FAMILY = ModelFamily(
    name="csm",
    description="Sesame CSM-1B (HF CsmForConditionalGeneration dir) + Mimi (HF MimiModel dir), local",
    preset_description="CSM layout: Llama backbone + depth decoder over 8 codebooks, small Mimi, random tiny weights",
    lm=CsmAdapter,
    codec=MimiCodec,
    sample_rate_hz=24000,
)

"""CSM family LM side (Sesame CSM on transformers' `CsmForConditionalGeneration` weights).

The Llama-style backbone runs in the continuous-batching engine on our slot KV cache and
predicts codebook 0 of each Mimi frame; the depth decoder then fills codebooks 1..K-1 for
every row of the batch at once, with a small cache that lives for one frame only. Positions
are K audio lanes + one text lane: text positions embed the text id, audio positions the
sum of their K codebook embeddings. A frame whose codebooks 0..K-2 are all EOS stops.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import CsmConfig, CsmForConditionalGeneration, DynamicCache

from core.checkpoints import hf_loader, load_or_preset, resolve_model_ref
from core.config import ModelConfig
from core.messages import ContextTurn, Job, SamplingParams
from detok_stage.codecs.mimi_codec import MimiCodec, shared_mimi, tiny_mimi_config
from llm_stage.inner_loop import InnerLoop
from llm_stage.models.base import Draws, FrameBuilder, LMAdapter, ModelFamily
from llm_stage.models.csm_depth import DepthRunner
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
    """sesame/csm-1b (a repo id in the local HF cache, or a dir) or the tiny random preset.

    The checkpoint's Mimi (`codec_model`, CSM's audio encoder) becomes this process's shared Mimi,
    the detokenizer's too (`shared_mimi`), so it is held once and kept in float32."""
    model = load_or_preset(
        config.checkpoint_dir,
        load=hf_loader(CsmForConditionalGeneration),
        preset=lambda: CsmForConditionalGeneration(tiny_csm_config()),
        seed=config.seed,
    )
    own_mimi, model.codec_model = model.codec_model, None
    model = model.to(config.device, getattr(torch, config.dtype)).eval()
    model.codec_model = shared_mimi(config, tiny_mimi_config(model.config.num_codebooks), loaded=own_mimi)
    return model


class CsmFrameBuilder(FrameBuilder):
    """Every generated step is already a whole frame of K codes."""

    def push(self, token_id: Token) -> list[list[int]]:
        return [list(token_id)]  # type: ignore[arg-type]


class CsmAdapter(LMAdapter):
    family = "csm"
    voices = tuple(str(i) for i in range(10))  # CSM speaker ids
    default_voice = "0"
    default_sampling = SamplingParams(temperature=0.9, top_k=50, max_tokens=375)
    uses_context_turns = True

    def __init__(self, model: CsmForConditionalGeneration, tokenizer: TextTokenizer) -> None:
        shim = SimpleNamespace(config=model.config, model=model.backbone_model, lm_head=model.lm_head)
        super().__init__(LlamaBackbone(shim))  # type: ignore[arg-type]
        self.model, self.tokenizer = model, tokenizer
        self.bos_id, self.eos_id = model.config.bos_token_id, model.config.eos_token_id
        if isinstance(tokenizer, HFTokenizer):  # the checkpoint's own special ids (Llama 3: 128000 / 128001)
            self.bos_id, self.eos_id = tokenizer.bos_id, tokenizer.eos_id
        self.num_codebooks = model.config.num_codebooks
        self.input_width = self.num_codebooks + 1
        self.pad_token = (0,) * self.num_codebooks + (model.config.pad_token_id,)
        self.eos_code = model.config.codebook_eos_token_id
        self.depth = DepthRunner(model.depth_decoder)
        self.inner_loop = InnerLoop(self.depth.static_codes, self.num_codebooks, "csm depth decoder")  # graph per size

    @classmethod
    def build(cls, config: ModelConfig) -> CsmAdapter:
        model = load_csm(config)
        if config.checkpoint_dir is not None:
            return cls(model, HFTokenizer(resolve_model_ref(config.checkpoint_dir), add_special_tokens=False))
        return cls(model, ByteTokenizer(offset=4, bos_id=None))

    def text_ids(self, text: str, voice: str | None) -> list[int]:
        """CsmProcessor's chat template for one text-only turn: BOS `[speaker]text` EOS."""
        return [self.bos_id, *self.tokenizer.encode(f"[{voice}]{text}"), self.eos_id]

    def format_prompt(self, text: str, voice: str | None) -> list[Token]:
        """The speaker's text turn as text positions; generation continues with audio frames."""
        return [(0,) * self.num_codebooks + (i,) for i in self.text_ids(text, voice)]

    def job_prompt(self, job: Job) -> list[Token]:
        """The job's turn after its context turns (an incremental stream's earlier segments)."""
        context = [token for turn in job.context for token in self.context_turn(turn)]
        return [*context, *self.format_prompt(job.text, job.voice)]

    def context_turn(self, turn: ContextTurn) -> list[Token]:
        """A previous turn as Sesame's generator feeds it: its text positions, its audio frames
        (K codes, no text), then an all-EOS frame closing the turn."""
        eos_frame = (self.eos_code,) * self.num_codebooks + (NO_TEXT,)
        audio = [(*frame, NO_TEXT) for frame in turn.frames]
        return [*self.format_prompt(turn.text, turn.voice), *audio, eos_frame]

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
        self, hidden: torch.Tensor, logits: torch.Tensor, cand: torch.Tensor | None, reqs: list[Request], draw: Draws
    ) -> list[Token]:
        """Codebook 0 from the backbone logits, then K-1 batched depth-decoder steps: chained on the
        device and read back once (`llm_stage.inner_loop`), or drawn per codebook on the host."""
        if not draw.chains_on_device(reqs):
            return self._sample_on_host(hidden, logits, reqs, draw)
        first = draw.on_device(logits, None, reqs, [0] * len(reqs))  # [B]
        eager = lambda row_draw: self.depth.codes_on_device(hidden, first, row_draw)  # noqa: E731
        return self.inner_loop.frame(draw, reqs, hidden, first, eager)

    def _sample_on_host(
        self, hidden: torch.Tensor, logits: torch.Tensor, reqs: list[Request], draw: Draws
    ) -> list[Token]:
        """transformers' depth decoder on a DynamicCache, each codebook's ids read back and uploaded again
        (CPU: numpy draws; repetition-aware rows)."""
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
    description="Sesame CSM-1B: CsmForConditionalGeneration checkpoint (safetensors + tokenizer); Mimi from its "
    "codec_model weights (or --codec kyutai/mimi)",
    preset_description="CSM layout: Llama backbone + depth decoder over 8 codebooks, small Mimi, random tiny weights",
    lm=CsmAdapter,
    codec=MimiCodec,
    sample_rate_hz=24000,
    frame_rate_hz=12.5,
    repo_id="sesame/csm-1b",
    codec_in_checkpoint=True,
    is_checkpoint=lambda config: config.get("model_type") == "csm",
)

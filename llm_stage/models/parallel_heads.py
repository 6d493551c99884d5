"""Parallel-heads SpeechLM in VoxRay's own checkpoint layout (Bagpiper / OpusLM-style architecture).

A position is K audio lanes plus one text lane; its embedding is the text embedding plus the
sum of the K stream embeddings. K output heads predict one id per stream per step, under a
delay pattern (stream k lags by delays[k]); only stream 0 may end the utterance, the others
then follow with EOS at their delays. CFG merges `uncond + g * (cond - uncond)`, the twin's
prompt being the same framing with no text. Frames go to an X-Codec detokenizer.

The checkpoint is our own layout (`save_parallel_heads`: a Qwen3 HF checkpoint plus
parallel_heads.safetensors / parallel_heads.json); it does not load published ESPnet / OpusLM
(Bagpiper) checkpoints, whose layout has no converter here, hence the family's name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from core.checkpoints import ModelRef, load_or_preset, resolve_model_ref
from core.config import ModelConfig
from core.messages import SamplingParams
from detok_stage.codecs.xcodec_codec import XcodecCodec
from llm_stage.cfg import GuidanceFormula
from llm_stage.delay_pattern import DelayPattern, StreamingDeinterleaver
from llm_stage.models.base import FrameBuilder, LMAdapter, ModelFamily
from llm_stage.models.delay_rules import apply_forced, check_stream0_leads, eos_step, forced_ids
from llm_stage.models.llama import LlamaBackbone
from llm_stage.models.tokenizers import ByteTokenizer, HFTokenizer, TextTokenizer
from llm_stage.request import Request, Token

HEADS_FILE = "parallel_heads.safetensors"
LAYOUT_FILE = "parallel_heads.json"


@dataclass(frozen=True)
class StreamLayout:
    """Codec streams and special ids of a parallel-heads checkpoint (saved as parallel_heads.json)."""

    num_streams: int = 8
    codebook_size: int = 1024
    delays: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)
    text_bos_id: int = 1
    audio_text_id: int = 2  # text lane of an audio position
    text_offset: int = 4  # byte tokenizer of the preset: id = offset + byte

    @property
    def eos_id(self) -> int:
        return self.codebook_size

    @property
    def pad_id(self) -> int:
        return self.codebook_size + 1

    @property
    def bos_id(self) -> int:
        return self.codebook_size + 2

    @property
    def stream_vocab(self) -> int:
        return self.codebook_size + 3

    @property
    def pattern(self) -> DelayPattern:
        return DelayPattern(tuple(self.delays), self.bos_id, self.pad_id)


class ParallelHeads(nn.Module):
    """Stream embeddings (one table with per-stream offsets) and the K output heads."""

    def __init__(self, layout: StreamLayout, hidden_size: int) -> None:
        super().__init__()
        self.num_streams, self.vocab = layout.num_streams, layout.stream_vocab
        self.embed = nn.Embedding(self.num_streams * self.vocab, hidden_size)
        self.heads = nn.Linear(hidden_size, self.num_streams * self.vocab, bias=False)
        self.register_buffer("offsets", torch.arange(self.num_streams) * self.vocab, persistent=False)

    def embed_streams(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, K] -> summed stream embeddings [B, T, H]."""
        return self.embed(codes + self.offsets).sum(dim=2)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> [B, K, V]."""
        return self.heads(hidden).view(hidden.shape[0], self.num_streams, self.vocab)


def tiny_qwen3_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=3,
    )  # fmt: skip


def save_parallel_heads(directory: Path, lm: Qwen3ForCausalLM, heads: ParallelHeads, layout: StreamLayout) -> None:
    """Write an HF-format checkpoint: the Qwen3 model, the heads' safetensors and the stream layout."""
    lm.save_pretrained(str(directory))
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(Path(directory) / HEADS_FILE))
    (Path(directory) / LAYOUT_FILE).write_text(json.dumps(asdict(StreamLayout(**asdict(layout)))))


def load_parallel_heads(config: ModelConfig) -> tuple[Qwen3ForCausalLM, ParallelHeads, StreamLayout]:
    """Local HF checkpoint (see `save_parallel_heads`), or the tiny preset with random weights."""
    lm, heads, layout = load_or_preset(
        config.checkpoint_dir, load=_load_parallel_heads_dir, preset=_parallel_heads_preset, seed=config.seed
    )
    dtype = getattr(torch, config.dtype)
    return lm.to(config.device, dtype).eval(), heads.to(config.device, dtype).eval(), layout


def _parallel_heads_preset() -> tuple[Qwen3ForCausalLM, ParallelHeads, StreamLayout]:
    layout, lm = StreamLayout(), Qwen3ForCausalLM(tiny_qwen3_config())
    heads = ParallelHeads(layout, lm.config.hidden_size)
    with torch.no_grad():  # wider than HF's init so greedy picks are not near-ties
        heads.heads.weight.normal_(0, 0.2)
    return lm, heads, layout


def _load_parallel_heads_dir(directory: Path) -> tuple[Qwen3ForCausalLM, ParallelHeads, StreamLayout]:
    layout_dict = json.loads((directory / LAYOUT_FILE).read_text())
    layout = StreamLayout(**{**layout_dict, "delays": tuple(layout_dict["delays"])})
    lm = Qwen3ForCausalLM.from_pretrained(str(directory), local_files_only=True)
    heads = ParallelHeads(layout, lm.config.hidden_size)
    heads.load_state_dict(load_file(str(directory / HEADS_FILE)))
    return lm, heads, layout


def text_tokenizer(directory: ModelRef | None, layout: StreamLayout) -> TextTokenizer:
    """The checkpoint's own tokenizer when it ships one, else the preset's byte tokenizer."""
    if directory is not None and any(
        (resolve_model_ref(directory) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return HFTokenizer(resolve_model_ref(directory))
    return ByteTokenizer(offset=layout.text_offset, bos_id=layout.text_bos_id)


class ParallelHeadsFrameBuilder(FrameBuilder):
    """De-interleaves delayed steps; frames holding a special id (BOS / EOS / PAD) are not audio."""

    def __init__(self, layout: StreamLayout) -> None:
        self.stream = StreamingDeinterleaver(layout.pattern)
        self.codebook_size = layout.codebook_size
        self.num_streams = layout.num_streams

    def push(self, token_id: Token) -> list[list[int]]:
        frames = self.stream.push(list(token_id)[: self.num_streams])  # type: ignore[arg-type]
        return [f for f in frames if max(f) < self.codebook_size]


class ParallelHeadsAdapter(LMAdapter):
    family = "parallel-heads"
    guidance = GuidanceFormula.LINEAR
    default_sampling = SamplingParams(temperature=0.9, top_k=50, max_tokens=1500)

    def __init__(
        self, lm: Qwen3ForCausalLM, heads: ParallelHeads, layout: StreamLayout, tokenizer: TextTokenizer
    ) -> None:
        super().__init__(LlamaBackbone(lm))
        check_stream0_leads(layout.pattern)
        self.heads, self.layout, self.tokenizer = heads, layout, tokenizer
        self.pattern = layout.pattern
        self.num_codebooks = layout.num_streams
        self.input_width = layout.num_streams + 1
        self.pad_token = (layout.pad_id,) * layout.num_streams + (layout.audio_text_id,)
        self._tail = self.pattern.max_delay - self.pattern.delays[0]  # steps after stream 0's EOS

    @classmethod
    def build(cls, config: ModelConfig) -> ParallelHeadsAdapter:
        lm, heads, layout = load_parallel_heads(config)
        return cls(lm, heads, layout, text_tokenizer(config.checkpoint_dir, layout))

    def _text_position(self, text_id: int) -> Token:
        return (self.layout.pad_id,) * self.layout.num_streams + (text_id,)

    def _frame(self, codes: tuple[int, ...]) -> Token:
        return (*codes, self.layout.audio_text_id)

    def format_prompt(self, text: str, voice: str | None) -> list[Token]:
        """Text positions, then one all-BOS audio position (generation continues the audio lanes)."""
        body = [self._text_position(i) for i in self.tokenizer.encode(text)]
        return [*body, self._frame((self.layout.bos_id,) * self.layout.num_streams)]

    @classmethod
    def twin_prompt_positions(cls, positions: int) -> int:
        """The twin's prompt is two positions whatever the text (`unconditional_prompt`)."""
        return 2

    def unconditional_prompt(self, text: str, voice: str | None) -> list[Token]:
        """The same framing with no text: text BOS, then the all-BOS audio position."""
        bos_frame = self._frame((self.layout.bos_id,) * self.layout.num_streams)
        return [self._text_position(self.layout.text_bos_id), bos_frame]

    def token_lanes(self, token: Token) -> list[int]:
        """Generated steps are K ids; the text lane of an audio position is `audio_text_id`."""
        lanes = list(token)  # type: ignore[arg-type]
        return lanes if len(lanes) == self.input_width else [*lanes, self.layout.audio_text_id]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T, K + 1] -> text embedding + summed stream embeddings [B, T, H]."""
        text = self.backbone.embed(ids[..., -1])
        return text + self.heads.embed_streams(ids[..., :-1])

    def logits(self, hidden: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, None]:
        return self.heads.logits(hidden).float(), None

    def constrain(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Streams > 0 never pick EOS/PAD/BOS, stream 0 never PAD/BOS; then the delay rules force ids."""
        logits[:, 1:, self.layout.eos_id :] = float("-inf")
        logits[:, 0, self.layout.eos_id + 1 :] = float("-inf")
        forced = [forced_ids(self.pattern, len(r.output_ids), self._end_step(r), self.layout.eos_id) for r in reqs]
        return apply_forced(logits, forced)

    def _end_step(self, req: Request) -> int | None:
        """Stream 0's EOS step; at the length limit the cascade starts so the last frames complete."""
        found = eos_step(req, self.layout.eos_id, self._tail + 1)
        limit = req.sampling.max_tokens - self._tail - 1
        return found if found is not None or len(req.output_ids) < limit else min(limit, len(req.output_ids))

    def is_stop(self, req: Request, token: Token) -> bool:
        step = len(req.output_ids)
        end = eos_step(req, self.layout.eos_id, self._tail + 1)
        if end is None and token[0] == self.layout.eos_id:  # type: ignore[index]
            end = step
        return end is not None and step >= end + self._tail

    def new_frame_builder(self) -> ParallelHeadsFrameBuilder:
        return ParallelHeadsFrameBuilder(self.layout)


FAMILY = ModelFamily(
    name="parallel-heads",
    description="VoxRay's own parallel-heads layout: Qwen3 HF checkpoint + parallel_heads.safetensors/.json "
    "(save_parallel_heads; not a published ESPnet / OpusLM checkpoint) + an X-Codec (XcodecModel) --codec",
    preset_description="Parallel heads + delay pattern + CFG (Qwen3, 8 X-Codec streams), random tiny weights",
    lm=ParallelHeadsAdapter,
    codec=XcodecCodec,
    sample_rate_hz=16000,
    frame_rate_hz=50.0,
)

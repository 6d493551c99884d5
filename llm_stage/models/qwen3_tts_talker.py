"""Qwen3-TTS talker weights in the published layout, and its code predictor run batched.

The talker is a Qwen3 decoder (per-head q/k norms; its multimodal RoPE has equal positions on all
three axes for speech, which is plain RoPE) over summed text and codec embeddings; `codec_head`
predicts codebook 0 of each 12.5 Hz frame. The code predictor, a small Qwen3 decoder, then
predicts codebooks 1..K-1 from the talker's last hidden state and codebook 0, one codebook per
forward, with a KV cache that lives for one frame. Modules are named as in the checkpoint
(`talker.model.layers.*`, `talker.code_predictor.lm_head.{k}`, ...), so its tensors load as
they are. Used by `llm_stage.models.qwen3_tts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from llm_stage.inner_loop import DeviceDrawK, InnerTable, StaticKV, table_draws
from llm_stage.models.llama import FusedLayer, apply_rotary, project, rms_norm

# Defaults of the reference configuration classes (qwen-tts 0.1.1) for fields a config.json may omit.
TALKER_DEFAULTS: dict[str, Any] = {
    "vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "attention_bias": False, "num_code_groups": 32, "text_hidden_size": 2048,
    "codec_eos_token_id": 4198, "codec_think_id": 4202, "codec_nothink_id": 4203, "codec_think_bos_id": 4204,
    "codec_think_eos_id": 4205, "codec_pad_id": 4196, "codec_bos_id": 4197, "max_position_embeddings": 32768,
}  # fmt: skip
PREDICTOR_DEFAULTS: dict[str, Any] = {
    "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "attention_bias": False, "num_code_groups": 32, "max_position_embeddings": 32768,
}  # fmt: skip


def with_defaults(fields: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    merged = {**defaults, **{k: v for k, v in fields.items() if v is not None}}
    merged.setdefault("head_dim", merged["hidden_size"] // merged["num_attention_heads"])
    return merged


def qwen3_config(fields: dict[str, Any]) -> Qwen3Config:
    """The transformers Qwen3 config of one decoder stack (talker or code predictor) for its layers and RoPE."""
    return Qwen3Config(
        vocab_size=fields["vocab_size"], hidden_size=fields["hidden_size"],
        intermediate_size=fields["intermediate_size"], num_hidden_layers=fields["num_hidden_layers"],
        num_attention_heads=fields["num_attention_heads"], num_key_value_heads=fields["num_key_value_heads"],
        head_dim=fields["head_dim"], hidden_act=fields["hidden_act"], rms_norm_eps=fields["rms_norm_eps"],
        attention_bias=fields["attention_bias"], max_position_embeddings=fields["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": float(fields["rope_theta"])},
    )  # fmt: skip


@dataclass(frozen=True)
class TalkerSpec:
    """The parts of a `qwen3_tts` config.json the LM side reads (reference defaults filled in)."""

    talker: dict[str, Any]
    predictor: dict[str, Any]
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TalkerSpec:
        talker_fields = dict(config.get("talker_config") or {})
        predictor = with_defaults(talker_fields.pop("code_predictor_config", None) or {}, PREDICTOR_DEFAULTS)
        talker = with_defaults(talker_fields, TALKER_DEFAULTS)
        if predictor["num_code_groups"] != talker["num_code_groups"]:
            raise ValueError("talker and code predictor disagree on num_code_groups")
        ids = {name: config.get(name, default) for name, default in
               (("tts_pad_token_id", 151671), ("tts_bos_token_id", 151672), ("tts_eos_token_id", 151673))}  # fmt: skip
        return cls(talker, predictor, ids["tts_pad_token_id"], ids["tts_bos_token_id"], ids["tts_eos_token_id"])

    @property
    def num_codebooks(self) -> int:
        return int(self.talker["num_code_groups"])


class Qwen3Stack(nn.Module):
    """Decoder layers + final norm + RoPE of one Qwen3 stack (the embeddings sit beside it)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)


class TalkerModel(Qwen3Stack):
    def __init__(self, spec: TalkerSpec) -> None:
        super().__init__(qwen3_config(spec.talker))
        fields = spec.talker
        self.codec_embedding = nn.Embedding(fields["vocab_size"], fields["hidden_size"])
        self.text_embedding = nn.Embedding(fields["text_vocab_size"], fields["text_hidden_size"])


class TextProjection(nn.Module):
    """Text embeddings (text_hidden_size) -> the talker's width: two biased linears around the activation."""

    def __init__(self, text_size: int, out_size: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_size, text_size, bias=True)
        self.linear_fc2 = nn.Linear(text_size, out_size, bias=True)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class CodePredictorModel(Qwen3Stack):
    def __init__(self, spec: TalkerSpec) -> None:
        super().__init__(qwen3_config(spec.predictor))
        vocab, talker_width = spec.predictor["vocab_size"], spec.talker["hidden_size"]
        self.codec_embedding = nn.ModuleList(nn.Embedding(vocab, talker_width) for _ in range(spec.num_codebooks - 1))


class CodePredictor(nn.Module):
    def __init__(self, spec: TalkerSpec) -> None:
        super().__init__()
        fields = spec.predictor
        self.model = CodePredictorModel(spec)
        self.lm_head = nn.ModuleList(
            nn.Linear(fields["hidden_size"], fields["vocab_size"], bias=False) for _ in range(spec.num_codebooks - 1)
        )
        talker_width = spec.talker["hidden_size"]
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(talker_width, fields["hidden_size"], bias=True)
            if fields["hidden_size"] != talker_width
            else nn.Identity()
        )


class Talker(nn.Module):
    def __init__(self, spec: TalkerSpec) -> None:
        super().__init__()
        fields = spec.talker
        self.model = TalkerModel(spec)
        self.text_projection = TextProjection(fields["text_hidden_size"], fields["hidden_size"], fields["hidden_act"])
        self.codec_head = nn.Linear(fields["hidden_size"], fields["vocab_size"], bias=False)
        self.code_predictor = CodePredictor(spec)


class Qwen3TTSModel(nn.Module):
    """The LM side of a Qwen3-TTS checkpoint: `talker.*` (the speaker encoder of Base models is not used)."""

    def __init__(self, spec: TalkerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.talker = Talker(spec)


class PredictorRunner:
    """Runs the code predictor for a batch of rows: a 2-position prefill (talker hidden state, codebook 0)
    then one position per codebook, attention over a per-call KV cache of at most K positions."""

    def __init__(self, predictor: CodePredictor) -> None:
        self.predictor = predictor
        stack = predictor.model
        cfg = stack.config
        self.layers = [FusedLayer(layer) for layer in stack.layers]
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def embed_codes(self, codes: torch.Tensor, codebook: int) -> torch.Tensor:
        """Input embeddings (talker width) of codebook `codebook` (1..K-1) ids."""
        return self.predictor.model.codec_embedding[codebook - 1](codes)

    def rope(self, like: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._rope
        stale = table is None or table[0].shape[0] < length
        if stale or table[0].device != like.device or table[0].dtype != like.dtype:
            positions = torch.arange(length, device=like.device).unsqueeze(0)
            cos, sin = self.predictor.model.rotary_emb(like, positions)
            table = self._rope = (cos[0], sin[0])
        return table

    def forward(self, x: torch.Tensor, start: int, cache: list[tuple[torch.Tensor, torch.Tensor]] | StaticKV):
        """x [B, T, talker width] at positions start..start+T-1 -> final-norm hidden of the last one [B, H];
        `cache`: the per-call list the host path grows, or the device path's static buffers."""
        hidden = self.predictor.small_to_mtp_projection(x)
        bsz, seq, _ = hidden.shape
        cos, sin = self.rope(hidden, start + seq)
        cos, sin = cos[start : start + seq].unsqueeze(0), sin[start : start + seq].unsqueeze(0)
        for index, fused in enumerate(self.layers):
            attend = lambda x: self._attention(index, fused, x, cos, sin, cache, start)  # noqa: B023, E731
            hidden = fused.pre_norm_block(hidden, attend)
        return rms_norm(self.predictor.model.norm, hidden[:, -1])

    def _attention(self, index, fused: FusedLayer, x, cos, sin, cache, start: int) -> torch.Tensor:
        bsz, seq, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = fused.qkv(x).view(bsz, seq, heads + 2 * kv_heads, dim).transpose(1, 2)  # [B, Hq + 2 Hkv, T, D]
        attn = fused.attn
        q = apply_rotary(attn.q_norm(qkv[:, :heads]), cos, sin)
        k = apply_rotary(attn.k_norm(qkv[:, heads : heads + kv_heads]), cos, sin)
        v = qkv[:, heads + kv_heads :]
        if isinstance(cache, StaticKV):
            out = cache.attend(index, q, k, v, start, dim**-0.5)
            return project(out.transpose(1, 2).reshape(bsz, seq, heads * dim), attn.o_proj.weight, attn.o_proj.bias)
        if index < len(cache):
            past_k, past_v = cache[index]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            cache[index] = (k, v)
        else:
            cache.append((k, v))
        causal = seq > 1 and k.shape[2] == seq  # the prefill; one new position attends to all before it
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, scale=dim**-0.5)
        return project(out.transpose(1, 2).reshape(bsz, seq, heads * dim), attn.o_proj.weight, attn.o_proj.bias)

    @torch.inference_mode()
    def predict(self, hidden: torch.Tensor, first: torch.Tensor, talker_codec_embedding: nn.Embedding, draw) -> list:
        """Codebooks 1..K-1 for each row: hidden [B, H] (talker, final norm), first [B] codebook-0 ids;
        `draw(logits [B, V], codebook)` picks ids. Returns [K-1][B] ids."""
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        x = torch.stack([hidden, talker_codec_embedding(first)], dim=1)  # [B, 2, H]
        out = self.forward(x, 0, cache)
        codes: list[list[int]] = []
        for codebook in range(1, len(self.predictor.lm_head) + 1):
            head = self.predictor.lm_head[codebook - 1]
            codes.append(draw(project(out, head.weight).float(), codebook))
            if codebook < len(self.predictor.lm_head):
                ids = torch.tensor(codes[-1], device=hidden.device)
                out = self.forward(self.embed_codes(ids, codebook).unsqueeze(1), codebook + 1, cache)
        return codes

    def codes_on_device(
        self, hidden: torch.Tensor, first: torch.Tensor, talker_codec_embedding: nn.Embedding, draw: DeviceDrawK
    ) -> torch.Tensor:
        """`predict` with the draws on the device and a static KV cache of K positions: [B, K-1] ids,
        nothing read back (a fixed-shape function of tensors when `draw` is `table_draws`)."""
        num_heads = len(self.predictor.lm_head)
        kv = StaticKV.empty(len(self.layers), hidden.shape[0], self.num_kv_heads, num_heads + 1, self.head_dim, hidden)
        x = torch.stack([hidden, talker_codec_embedding(first)], dim=1)  # [B, 2, H]
        out = self.forward(x, 0, kv)
        codes: list[torch.Tensor] = []  # [K-1][B]
        for codebook in range(1, num_heads + 1):
            head = self.predictor.lm_head[codebook - 1]
            codes.append(draw(project(out, head.weight).float(), codebook))
            if codebook < num_heads:
                out = self.forward(self.embed_codes(codes[-1], codebook).unsqueeze(1), codebook + 1, kv)
        return torch.stack(codes, dim=1)

    def static_codes(
        self, talker_codec_embedding: nn.Embedding
    ) -> Callable[[torch.Tensor, torch.Tensor, InnerTable], torch.Tensor]:
        """The inner loop `llm_stage.inner_loop.InnerLoop` captures: every draw from the table."""
        return lambda hidden, first, table: self.codes_on_device(
            hidden, first, talker_codec_embedding, table_draws(table)
        )

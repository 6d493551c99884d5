"""Llama backbone forward over our slot KV cache, on the weights of a transformers model.

Norms, MLP activation and rotary tables come from transformers' own modules; attention is ours
(per-token slot/position writes; one token per row reads its own cached tokens in place,
`llm_stage.attention.decode_attention`; longer inputs one masked SDPA per layer), so any number of
requests at different lengths run in one forward. Used by LM adapters of Llama/Qwen-architecture
families.

Per layer the q/k/v projections run as one matmul, and so do gate/up: the model's projection
weights are rebound to row slices of one fused tensor (no extra memory; transformers' modules
read the same numbers). fp32 norms are `F.rms_norm` (the same arithmetic as transformers' RMSNorm
in fp32) and static rotary tables are built once per cache length: a decode step of a small
model on CPU is dominated by per-op overhead and by streaming weights from memory, hence also
the weight-major `project` for decode-sized inputs on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llm_stage.add_norm import add_rms_norm, fused_add_norm_works
from llm_stage.attention import decode_attention, triton_available
from llm_stage.kv_cache import KVCache
from llm_stage.rope_cache import fused_rope_works, rope_and_cache


@dataclass(frozen=True)
class BatchInputs:
    """One forward's inputs; padded rows carry the scratch slot in `write_slots`."""

    input_ids: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    slots: torch.Tensor  # [B] cache row of each request
    write_slots: torch.Tensor  # [B, T] cache row for each token (scratch for padding)
    last_index: torch.Tensor  # [B] index in T of each row's last real token
    # host-known: cache positions a multi-token forward attends to (its last position + 1), so the
    # forward never reads it back from the device; None = read `positions` (one sync)
    attend_len: int | None = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


DECODE_ROWS = 8  # inputs up to this many rows take `project`'s weight-major product on CPU


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias). On CPU in fp32, for 2..DECODE_ROWS rows, as (weight @ x^T)^T:
    once the weight is out of cache (every decode step: the slot heads evict it) MKL multiplies
    the row-major weight by a few columns faster than the transposed-weight form F.linear uses.
    bf16 / fp16 weights gain nothing from it, so they keep F.linear."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or weight.dtype != torch.float32 or not 1 < rows <= DECODE_ROWS:
        return F.linear(x, weight, bias)
    columns = x.reshape(rows, x.shape[-1]).T
    product = weight @ columns if bias is None else torch.addmm(bias.unsqueeze(1), weight, columns)
    return product.T.contiguous().view(*x.shape[:-1], weight.shape[0])


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum(out), in] weight (and bias) for `linears`, which are rebound to its row slices."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


def add_and_norm(hidden: torch.Tensor, delta: torch.Tensor, norm: nn.Module, fuse: bool):
    """(hidden + delta, its RMSNorm): one kernel when `fuse` and the norm is transformers' RMSNorm."""
    eps = getattr(norm, "variance_epsilon", None)
    if fuse and eps is not None:
        return add_rms_norm(hidden, delta, norm.weight, eps)
    total = hidden + delta
    return total, rms_norm(norm, total)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm (normalise in fp32, round to the input dtype, then scale by the
    weight) as one fused op in fp32, and as fused op + cast + scale in bf16 / fp16: 3 kernels
    instead of 8 per norm, 56 norms a step at Orpheus 3B's 28 layers."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        return norm(x)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class FusedLayer:
    """One decoder layer's weights as the backbone uses them: fused q/k/v and (where the MLP is
    the usual bias-free SwiGLU) fused gate/up."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.attn, self.mlp = layer, attn, mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        if len({p.bias is None for p in projections}) == 1:
            self.qkv_weight, self.qkv_bias = fuse_linears(projections)
        else:
            self.qkv_weight = self.qkv_bias = None
        swiglu = all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        no_bias = swiglu and mlp.gate_proj.bias is None and mlp.up_proj.bias is None
        self.gate_up_weight = fuse_linears([mlp.gate_proj, mlp.up_proj])[0] if no_bias else None

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv_weight is None:
            return torch.cat([self.attn.q_proj(x), self.attn.k_proj(x), self.attn.v_proj(x)], dim=-1)
        return project(x, self.qkv_weight, self.qkv_bias)

    def mlp_out(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.mlp(x)
        gate, up = project(x, self.gate_up_weight).chunk(2, dim=-1)
        down = self.mlp.down_proj
        return project(self.mlp.act_fn(gate) * up, down.weight, down.bias)

    def pre_norm_block(self, hidden: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer as pre-norm residual blocks: `attend` (the caller's attention) on the normed input,
        then the MLP; for the small decoders that run their own attention (CSM's depth decoder, Qwen3-TTS's
        code predictor)."""
        hidden = hidden + attend(rms_norm(self.layer.input_layernorm, hidden))
        return hidden + self.mlp_out(rms_norm(self.layer.post_attention_layernorm, hidden))


@dataclass(frozen=True)
class DecodeContext:
    """One token per row: attention over each row's own `seq_lens` cached tokens, read in place."""

    slots: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] int32, on the device

    def attend(self, q: torch.Tensor, cache: KVCache, layer: int, scale: float) -> torch.Tensor:
        keys, values = cache.layer(layer)
        out = decode_attention(q[:, :, 0], keys, values, self.slots, self.seq_lens, scale, cache.table)
        return out.unsqueeze(2)


@dataclass(frozen=True)
class PromptContext:
    """Several tokens per row (prompt chunks): masked SDPA over the first `length` cache positions."""

    slots: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, 1, T, L]
    length: int

    @classmethod
    def of(cls, batch: BatchInputs, length: int | None) -> PromptContext:
        if length is None:
            length = batch.attend_len if batch.attend_len is not None else int(batch.positions.max()) + 1
        key_pos = torch.arange(length, device=batch.positions.device)
        mask = key_pos.view(1, 1, 1, -1) <= batch.positions.unsqueeze(1).unsqueeze(-1)
        return cls(batch.slots, mask, length)

    def attend(self, q: torch.Tensor, cache: KVCache, layer: int, scale: float) -> torch.Tensor:
        keys, values = cache.read(layer, self.slots, self.length)  # [B, KV, L, D]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=True)


class LlamaBackbone:
    """Runs `LlamaModel`-compatible weights (decoder layers + final norm) on a KV cache of either layout."""

    supports_decode_graphs = True
    state_is_slot_kv = True  # a stream's whole state here is its rows of the slot KV cache (KV migration)

    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        self.hf_model = hf_model
        self.model = hf_model.model  # LlamaModel / Qwen2Model / Qwen3Model
        self.lm_head_weight: torch.Tensor = hf_model.lm_head.weight  # [V, H]
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.scale = self.head_dim**-0.5
        self.layers = [FusedLayer(layer) for layer in self.model.layers]
        rope_type = getattr(self.model.rotary_emb, "rope_type", "default")
        self._static_rope = "dynamic" not in rope_type and rope_type != "longrope"  # tables depend on length
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        # rotary + cache write as one kernel (`llm_stage.rope_cache`), residual add + RMSNorm as one
        # (`llm_stage.add_norm`); None = on CUDA when Triton is there and the kernel checked out
        self.fuse_rope_cache: bool | None = None
        self.fuse_add_norm: bool | None = None

    def _fuses_add_norm(self, x: torch.Tensor) -> bool:
        if self.fuse_add_norm is None:
            return x.is_cuda and triton_available() and fused_add_norm_works(x.device.index or 0)
        return self.fuse_add_norm

    def _fuses_rope(self, x: torch.Tensor) -> bool:
        if self.fuse_rope_cache is None:  # on CUDA once the kernel proved itself on this GPU
            return x.is_cuda and triton_available() and fused_rope_works(x.device.index or 0)
        return self.fuse_rope_cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] at `positions`: rows of a table over [0, max_len) for static rope types."""
        if not self._static_rope:
            return self.model.rotary_emb(hidden, positions)
        table = self._rope_table
        cos = None if table is None else table[0]
        if cos is None or cos.shape[0] < max_len or cos.device != hidden.device or cos.dtype != hidden.dtype:
            table = self._rope_table = self._build_rope_table(hidden, max_len)
        return table[0][positions], table[1][positions]

    def _build_rope_table(self, hidden: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(max_len, device=hidden.device).unsqueeze(0)
        cos, sin = self.model.rotary_emb(hidden, positions)
        return cos[0], sin[0]

    @torch.inference_mode()
    def forward(
        self, batch: BatchInputs, cache: KVCache, embeds: torch.Tensor | None = None, length: int | None = None
    ) -> torch.Tensor:
        """Returns the final-norm hidden state at each row's last real token: [B, H].

        One token per row (decode): each row attends to its own cached tokens, lengths on the device
        (so a CUDA graph serves every length). Longer inputs attend to `length` cache positions
        (default: `batch.attend_len`, else up to the batch's last position).
        """
        hidden = self.embed(batch.input_ids) if embeds is None else embeds  # [B, T, H]
        cos, sin = self.rotary(hidden, batch.positions, cache.max_seq_len)  # [B, T, D]
        if batch.input_ids.shape[1] == 1:
            context = DecodeContext(batch.slots, (batch.positions[:, 0] + 1).to(torch.int32))
        else:
            context = PromptContext.of(batch, length)
        fuse = self._fuses_add_norm(hidden)
        normed = rms_norm(self.layers[0].layer.input_layernorm, hidden)
        for index, fused in enumerate(self.layers):
            attn_out = self._attention(index, fused, normed, batch, cache, cos, sin, context)
            hidden, normed = add_and_norm(hidden, attn_out, fused.layer.post_attention_layernorm, fuse)
            mlp_out = fused.mlp_out(normed)
            if index + 1 < len(self.layers):  # the next layer's input norm
                hidden, normed = add_and_norm(hidden, mlp_out, self.layers[index + 1].layer.input_layernorm, fuse)
            else:
                hidden = hidden + mlp_out
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return rms_norm(self.model.norm, hidden[rows, batch.last_index])

    def _attention(self, index, fused: FusedLayer, x, batch, cache, cos, sin, context) -> torch.Tensor:
        bsz, seq, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        attn = fused.attn
        has_head_norms = getattr(attn, "q_norm", None) is not None
        if self._fuses_rope(x) and not has_head_norms:  # rotation and cache write in one kernel
            q = rope_and_cache(
                fused.qkv(x).view(bsz * seq, -1), cos.reshape(bsz * seq, dim), sin.reshape(bsz * seq, dim),
                batch.write_slots.flatten(), batch.positions.flatten(), *cache.layer(index), heads, kv_heads,
                cache.table,
            ).view(bsz, seq, heads, dim).transpose(1, 2)  # fmt: skip
            out = context.attend(q, cache, index, self.scale)
            return project(out.transpose(1, 2).reshape(bsz, seq, heads * dim), attn.o_proj.weight, attn.o_proj.bias)
        qkv = fused.qkv(x).view(bsz, seq, heads + 2 * kv_heads, dim).transpose(1, 2)  # [B, Hq + 2 Hkv, T, D]
        v = qkv[:, heads + kv_heads :]
        if has_head_norms:  # Qwen3: per-head norms before rotary
            q, k = attn.q_norm(qkv[:, :heads]), attn.k_norm(qkv[:, heads : heads + kv_heads])
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:  # queries and keys rotate together
            qk = apply_rotary(qkv[:, : heads + kv_heads], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        flat_k = k.transpose(1, 2).reshape(bsz * seq, kv_heads, dim)
        flat_v = v.transpose(1, 2).reshape(bsz * seq, kv_heads, dim)
        cache.write(index, batch.write_slots.flatten(), batch.positions.flatten(), flat_k, flat_v)
        out = context.attend(q, cache, index, self.scale)  # [B, Hq, T, D]
        return project(out.transpose(1, 2).reshape(bsz, seq, heads * dim), attn.o_proj.weight, attn.o_proj.bias)

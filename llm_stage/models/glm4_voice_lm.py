"""GLM-4-Voice 9B's LM at its published layout, the `glm4-voice-tiny` preset, and its token ids.

The published directory (THUDM/glm-4-voice-9b) is a ChatGLM checkpoint: config.json (`model_type:
chatglm`, remote code), safetensors under `transformer.*` (`embedding.word_embeddings`, per layer
`self_attention.query_key_value` (q, k, v rows with biases), `self_attention.dense`,
`mlp.dense_h_to_4h` (gate then up), `mlp.dense_4h_to_h`, two RMSNorms; `encoder.final_layernorm`,
`output_layer`), and GLM-4's tiktoken tokenizer (`llm_stage.models.glm4_bpe`). The weights load into
a transformers `GlmForCausalLM` (GLM-4-9B as transformers implements it: 2 KV heads, qkv biases,
rotary over the first half of each head in interleaved pairs) that `GlmBackbone` runs on our KV
cache. One change at load: each head's q / k rows (and biases) are permuted so the interleaved
pairs (2i, 2i + 1) become the rotate-half pairs (i, i + head_dim / 2) and the unrotated dims sit
where the backbone's tables give cos 1 / sin 0 (`rotary_permutation`): attention scores are
unchanged, since the same permutation is applied to q and k, and the engine's rotary path and
fused kernels run as for Llama. So the loaded module is GlmModel-shaped but its q / k rows are in
that layout: transformers' own forward over it is not the published model. Used by the glm4-voice
adapter (`llm_stage.models.glm4_voice`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from transformers import GlmConfig, GlmForCausalLM
from transformers.models.glm.modeling_glm import GlmRotaryEmbedding

from core.checkpoints import load_or_preset, load_prefixed_state
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from llm_stage.models.llama import LlamaBackbone

FIELD = "model.checkpoint_dir"
PRESET_TEXT_IDS = range(1000, 1256)  # the preset's byte tokenizer: byte b is id 1000 + b
AUDIO_CODES = 16384  # the WhisperVQ speech tokenizer's codebook: <|audio_0|> .. <|audio_16383|>
ROPE_BASE = 10000.0  # ChatGLM's rotary base, times config.json's `rope_ratio`
INV_FREQ_KEY = "transformer.rotary_pos_emb.inv_freq"  # a buffer some ChatGLM checkpoints carry


@dataclass(frozen=True)
class SpecialIds:
    """The ids that frame a prompt and split an answer. A checkpoint's come from its tokenizer by name
    (`from_vocab`); the defaults are GLM-4's (its 14 special tokens follow the 151329 BPE ranks),
    `<|audio_0|>` at 152353 as public GLM-4-Voice code states it, and `<|begin_of_audio|>` /
    `<|end_of_audio|>` taken as the two ids after GLM-4's specials (unconfirmed: read by name)."""

    endoftext: int = 151329  # <|endoftext|>: a stop (the published generation config's eos ids)
    gmask: int = 151331  # [gMASK]: the tokenizer's prefix, then <sop>
    sop: int = 151333  # <sop>
    system: int = 151335  # <|system|>
    user: int = 151336  # <|user|>: opens a user turn; the answer's stop
    assistant: int = 151337  # <|assistant|>
    observation: int = 151338  # <|observation|>: a stop
    begin_of_audio: int = 151343  # <|begin_of_audio|>
    end_of_audio: int = 151344  # <|end_of_audio|>
    first_audio: int = 152353  # <|audio_0|>: speech token N is first_audio + N

    NAMES = {
        "endoftext": "<|endoftext|>", "gmask": "[gMASK]", "sop": "<sop>", "system": "<|system|>",
        "user": "<|user|>", "assistant": "<|assistant|>", "observation": "<|observation|>",
        "begin_of_audio": "<|begin_of_audio|>", "end_of_audio": "<|end_of_audio|>", "first_audio": "<|audio_0|>",
    }  # fmt: skip

    @classmethod
    def from_vocab(cls, vocab: dict[str, int]) -> SpecialIds:
        missing = [name for name in cls.NAMES.values() if name not in vocab]
        if missing:
            raise InvalidArgumentError(FIELD, f"the tokenizer lacks GLM-4-Voice's tokens {missing}")
        ids = cls(**{f.name: vocab[cls.NAMES[f.name]] for f in fields(cls)})
        for code in (1, AUDIO_CODES - 1):  # speech ids are <|audio_0|> + N (the last may be absent: issue
            name = f"<|audio_{code}|>"  # reports on the published repo count 16383 speech tokens in its vocab)
            if name in vocab and vocab[name] != ids.first_audio + code:
                raise InvalidArgumentError(FIELD, f"the tokenizer's {name} is not <|audio_0|> + {code}")
        return ids

    @property
    def stops(self) -> frozenset[int]:
        """The ids that end an answer, as the published generation config lists them."""
        return frozenset({self.endoftext, self.user, self.observation})

    def audio_code(self, token: int) -> int | None:
        """The speech code of an output id (0..16383), or None for text and control ids."""
        code = token - self.first_audio
        return code if 0 <= code < AUDIO_CODES else None

    def is_text(self, token: int) -> bool:
        """Text the client reads: the BPE ranks, below every special token."""
        return 0 <= token < self.endoftext


def glm_config(config: dict) -> GlmConfig:
    """transformers' GlmConfig of a ChatGLM config.json; a variant the GLM body does not run is refused."""
    unsupported = {
        "rmsnorm": False, "add_bias_linear": True, "apply_residual_connection_post_layernorm": True,
        "post_layer_norm": False, "original_rope": False,
    }  # fmt: skip
    for key, bad in unsupported.items():
        if config.get(key, not bad) == bad:
            raise InvalidArgumentError(FIELD, f"config.json's {key}: {bad} is not GLM-4's layout")
    try:
        heads, kv_channels = config["num_attention_heads"], config["kv_channels"]
        kv_heads = config["multi_query_group_num"] if config.get("multi_query_attention", True) else heads
        rope = {
            "rope_type": "default", "rope_theta": ROPE_BASE * float(config.get("rope_ratio", 1)),
            "partial_rotary_factor": 0.5,  # ChatGLM rotates half of each head (kv_channels // 2)
        }  # fmt: skip
        return GlmConfig(
            vocab_size=config["padded_vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["ffn_hidden_size"], num_hidden_layers=config["num_layers"],
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=kv_channels,
            max_position_embeddings=config.get("seq_length", 131072), rms_norm_eps=config["layernorm_epsilon"],
            attention_bias=bool(config.get("add_qkv_bias", True)), rope_parameters=rope,
            tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
    except KeyError as err:
        raise InvalidArgumentError(FIELD, f"config.json lacks {err.args[0]}") from None


def rotary_dim(config: GlmConfig) -> int:
    return int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))


def rotary_permutation(head_dim: int, rotary: int) -> torch.Tensor:
    """New position -> published dim of one head: the interleaved rotary pairs (2i, 2i + 1) go to
    (i, i + head_dim / 2), the unrotated dims fill the rest of each half in order."""
    if rotary % 2 or (head_dim - rotary) % 2:
        raise InvalidArgumentError(FIELD, f"rotary dims {rotary} of head_dim {head_dim} do not split in pairs")
    passed = list(range(rotary, head_dim))
    half = len(passed) // 2
    order = list(range(0, rotary, 2)) + passed[:half] + list(range(1, rotary, 2)) + passed[half:]
    return torch.tensor(order)


def rotary_tables(
    max_len: int, head_dim: int, rotary: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim] for the permuted layout: each rotary frequency at i and i + head_dim / 2
    (rotate-half), cos 1 / sin 0 on the unrotated dims; computed in fp32 as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary, 2, dtype=torch.float, device=device) / rotary))
    angles = torch.arange(max_len, device=device, dtype=torch.float)[:, None] * inv_freq[None]  # [L, rotary / 2]
    ones = torch.ones(max_len, (head_dim - rotary) // 2, device=device)
    cos = torch.cat([angles.cos(), ones, angles.cos(), ones], dim=-1)
    sin = torch.cat([angles.sin(), ones * 0, angles.sin(), ones * 0], dim=-1)
    return cos.to(dtype), sin.to(dtype)


class GlmBackbone(LlamaBackbone):
    """`LlamaBackbone` on a `GlmForCausalLM` loaded by `build_glm` (q / k rows in the rotate-half layout):
    only the rotary tables differ (`rotary_tables`); attention, cache, graphs and kernels are Llama's."""

    def __init__(self, hf_model: GlmForCausalLM) -> None:
        super().__init__(hf_model)
        self.rotary_dim = rotary_dim(hf_model.config)
        self.rope_theta = float(hf_model.config.rope_parameters["rope_theta"])

    def _build_rope_table(self, hidden: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(max_len, self.head_dim, self.rotary_dim, self.rope_theta, hidden.device, hidden.dtype)


def glm_state(chatglm: dict[str, torch.Tensor], config: GlmConfig) -> dict[str, torch.Tensor]:
    """The published ChatGLM tensors under transformers' GLM names, q / k rows permuted per head
    (`rotary_permutation`); a missing or unexpected key is refused."""
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    perm = rotary_permutation(dim, rotary_dim(config))
    state = dict(chatglm)
    state.pop(INV_FREQ_KEY, None)

    def take(key: str) -> torch.Tensor:
        if key not in state:
            raise InvalidArgumentError(FIELD, f"the checkpoint lacks {key}")
        return state.pop(key)

    def permuted(rows: torch.Tensor, num_heads: int) -> torch.Tensor:  # [num_heads * dim, ...] per head
        return rows.reshape(num_heads, dim, -1)[:, perm].reshape(rows.shape)

    out = {
        "model.embed_tokens.weight": take("transformer.embedding.word_embeddings.weight"),
        "model.norm.weight": take("transformer.encoder.final_layernorm.weight"),
        "lm_head.weight": take("transformer.output_layer.weight"),
    }
    parts = ("weight", "bias") if config.attention_bias else ("weight",)
    for i in range(config.num_hidden_layers):
        src, dst = f"transformer.encoder.layers.{i}.", f"model.layers.{i}."
        for part in parts:
            fused = take(f"{src}self_attention.query_key_value.{part}")
            q, k, v = fused.split([heads * dim, kv_heads * dim, kv_heads * dim])
            out[f"{dst}self_attn.q_proj.{part}"] = permuted(q, heads)
            out[f"{dst}self_attn.k_proj.{part}"] = permuted(k, kv_heads)
            out[f"{dst}self_attn.v_proj.{part}"] = v
        out[f"{dst}self_attn.o_proj.weight"] = take(f"{src}self_attention.dense.weight")
        out[f"{dst}mlp.gate_up_proj.weight"] = take(f"{src}mlp.dense_h_to_4h.weight")  # gate rows, then up
        out[f"{dst}mlp.down_proj.weight"] = take(f"{src}mlp.dense_4h_to_h.weight")
        out[f"{dst}input_layernorm.weight"] = take(f"{src}input_layernorm.weight")
        out[f"{dst}post_attention_layernorm.weight"] = take(f"{src}post_attention_layernorm.weight")
    if state:
        raise InvalidArgumentError(FIELD, f"unexpected keys in the checkpoint: {sorted(state)[:5]}")
    return out


def check_inv_freq(chatglm: dict[str, torch.Tensor], config: GlmConfig) -> None:
    """A checkpoint's stored rotary frequencies, where it carries them, must be the ones config.json gives."""
    stored = chatglm.get(INV_FREQ_KEY)
    if stored is None:
        return
    rotary, theta = rotary_dim(config), float(config.rope_parameters["rope_theta"])
    expected = 1.0 / (theta ** (torch.arange(0, rotary, 2, dtype=torch.float) / rotary))
    if stored.shape != expected.shape or not torch.allclose(stored.float(), expected, rtol=1e-2):
        raise InvalidArgumentError(FIELD, f"{INV_FREQ_KEY} does not match config.json's rope_ratio")


def build_glm(glm: GlmConfig, chatglm: dict[str, torch.Tensor]) -> GlmForCausalLM:
    """A `GlmForCausalLM` holding ChatGLM tensors (no random init of a 9B body: built on the meta device,
    the tensors assigned, the rotary buffer rebuilt)."""
    check_inv_freq(chatglm, glm)
    state = glm_state(chatglm, glm)
    with torch.device("meta"):
        model = GlmForCausalLM(glm)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:  # a shape that does not fit config.json
        raise InvalidArgumentError(FIELD, f"the weights do not fit config.json: {err}") from None
    model.model.rotary_emb = GlmRotaryEmbedding(glm)  # unused by GlmBackbone, kept real for `.to()`
    return model


def tiny_config() -> dict:
    """The glm4-voice-tiny config.json: ChatGLM's fields, the published vocabulary, toy widths."""
    return {
        "architectures": ["ChatGLMModel"], "model_type": "chatglm", "torch_dtype": "float32",
        "padded_vocab_size": 168960, "hidden_size": 64, "ffn_hidden_size": 96, "num_layers": 2,
        "num_attention_heads": 4, "kv_channels": 16, "multi_query_attention": True, "multi_query_group_num": 2,
        "seq_length": 8192, "layernorm_epsilon": 1.5625e-07, "rmsnorm": True, "add_qkv_bias": True,
        "add_bias_linear": False, "post_layer_norm": True, "original_rope": True, "rope_ratio": 1,
        "apply_residual_connection_post_layernorm": False, "eos_token_id": [151329, 151336, 151338],
        "pad_token_id": 151329,
    }  # fmt: skip


def random_chatglm_state(config: dict) -> dict[str, torch.Tensor]:
    """Random weights under the published keys, wider than a usual init so greedy picks are not near-ties;
    the head's rows but the ids the preset's byte tokenizer spells, the speech ids and `<|user|>` shrunk a
    thousandfold, so the model answers in text and speech as the real one does."""
    hidden, ffn, vocab = config["hidden_size"], config["ffn_hidden_size"], config["padded_vocab_size"]
    qkv = (config["num_attention_heads"] + 2 * config["multi_query_group_num"]) * config["kv_channels"]
    state = {
        "transformer.embedding.word_embeddings.weight": torch.randn(vocab, hidden) * 0.2,
        "transformer.encoder.final_layernorm.weight": 1 + 0.1 * torch.randn(hidden),
        "transformer.output_layer.weight": torch.randn(vocab, hidden) * 0.2,
    }
    for i in range(config["num_layers"]):
        prefix = f"transformer.encoder.layers.{i}."
        state.update({
            f"{prefix}input_layernorm.weight": 1 + 0.1 * torch.randn(hidden),
            f"{prefix}self_attention.query_key_value.weight": torch.randn(qkv, hidden) * 0.2,
            f"{prefix}self_attention.query_key_value.bias": torch.randn(qkv) * 0.2,
            f"{prefix}self_attention.dense.weight": torch.randn(hidden, config["num_attention_heads"]
                                                                * config["kv_channels"]) * 0.2,
            f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden),
            f"{prefix}mlp.dense_h_to_4h.weight": torch.randn(2 * ffn, hidden) * 0.2,
            f"{prefix}mlp.dense_4h_to_h.weight": torch.randn(hidden, ffn) * 0.2,
        })  # fmt: skip
    ids, spoken = SpecialIds(), torch.zeros(vocab, dtype=torch.bool)
    spoken[PRESET_TEXT_IDS.start : PRESET_TEXT_IDS.stop] = True
    spoken[ids.first_audio : ids.first_audio + AUDIO_CODES] = True
    spoken[ids.user] = True
    state["transformer.output_layer.weight"][~spoken] *= 1e-3
    return state


def tiny_glm4_voice() -> GlmForCausalLM:
    return build_glm(glm_config(tiny_config()), random_chatglm_state(tiny_config()))


def is_glm4_voice_config(config: dict) -> bool:
    """A ChatGLM config.json with GLM-4-Voice's vocabulary (GLM-4-9B's own is 151552)."""
    return config.get("model_type") == "chatglm" and config.get("padded_vocab_size") == 168960


def load_published(directory: Path) -> GlmForCausalLM:
    """config.json + every `transformer.*` tensor of the (sharded) safetensors, under the published names."""
    path = directory / "config.json"
    if not path.is_file():
        raise InvalidArgumentError(FIELD, f"{directory} has no config.json")
    glm = glm_config(json.loads(path.read_text()))  # checked before any weight is read
    return build_glm(glm, load_prefixed_state(directory, ""))


def load_glm4_voice(config: ModelConfig) -> GlmForCausalLM:
    """The published directory (a path or repo id in the local HF cache) or the seeded tiny preset."""
    model = load_or_preset(config.checkpoint_dir, load=load_published, preset=tiny_glm4_voice, seed=config.seed)
    return model.to(config.device, getattr(torch, config.dtype)).eval()

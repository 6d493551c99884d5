"""A tiny random GLM-4-Voice 9B written the way THUDM/glm-4-voice-9b is published: config.json
(`model_type: chatglm`, `auto_map` to the remote code, ChatGLM's field names), sharded safetensors with
`model.safetensors.index.json` under the ChatGLM keys (`transformer.embedding.word_embeddings`,
`transformer.encoder.layers.N.self_attention.query_key_value` ..., `transformer.output_layer`,
`transformer.rotary_pos_emb.inv_freq`), and GLM-4's tokenizer files: `tokenizer.model` (tiktoken ranks:
every byte, then merges spelling a few words) and tokenizer_config.json whose `added_tokens_decoder`
puts GLM-4's specials, the audio framing and `<|audio_0|>` .. `<|audio_16383|>` at the published ids.
Tests load it back through the real loader."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import torch

from llm_stage.models.glm4_bpe import GLM4_SPECIALS
from llm_stage.models.glm4_voice_lm import (
    AUDIO_CODES,
    INV_FREQ_KEY,
    ROPE_BASE,
    SpecialIds,
    random_chatglm_state,
    tiny_config,
)
from tests.sharded_safetensors import write_sharded

REPO_ID = "THUDM/glm-4-voice-9b"
SHARD_BYTES = 24 * 2**20  # small shards, so the index and more than one file are exercised
WORDS = ("hello", " the", " stream", "streaming", "_transcription", " audio", " text", "ing", "User", " token")


def glm4_voice_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ChatGLM-keyed weights at the tiny sizes, with the rotary buffer the published files carry."""
    torch.manual_seed(seed)
    config = tiny_config()
    state = random_chatglm_state(config)
    rotary = config["kv_channels"] // 2
    state[INV_FREQ_KEY] = 1.0 / (ROPE_BASE ** (torch.arange(0, rotary, 2, dtype=torch.float) / rotary))
    return state


def bpe_ranks() -> dict[bytes, int]:
    """Every byte, then each word's prefixes (so every token is one merge of two earlier ones)."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in WORDS:
        spelled = word.encode()
        for end in range(2, len(spelled) + 1):
            ranks.setdefault(spelled[:end], len(ranks))
    return ranks


def special_tokens(ids: SpecialIds = SpecialIds()) -> dict[str, int]:
    """GLM-4's 14 specials at 151329.., the audio framing and the 16384 speech tokens at the published ids."""
    named = {name: ids.endoftext + i for i, name in enumerate(GLM4_SPECIALS)}
    named.update({"<|begin_of_audio|>": ids.begin_of_audio, "<|end_of_audio|>": ids.end_of_audio})
    named.update({f"<|audio_{n}|>": ids.first_audio + n for n in range(AUDIO_CODES)})
    return named


def write_tokenizer(directory: Path) -> None:
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in bpe_ranks().items()]
    (directory / "tokenizer.model").write_text("\n".join(lines) + "\n")
    decoder = {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for name, i in special_tokens().items()}  # fmt: skip
    config = {
        "added_tokens_decoder": decoder, "clean_up_tokenization_spaces": False, "do_lower_case": False,
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]}, "eos_token": "<|endoftext|>",
        "model_max_length": 1000000000000000019884624838656, "pad_token": "<|endoftext|>", "padding_side": "left",
        "remove_space": False, "tokenizer_class": "ChatGLM4Tokenizer",
    }  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def published_config() -> dict:
    config = tiny_config()
    config.update(
        torch_dtype="bfloat16", transformers_version="4.44.1", fp32_residual_connection=False,
        auto_map={
            "AutoConfig": "configuration_chatglm.ChatGLMConfig",
            "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
        },
    )  # fmt: skip
    return config


def write_glm4_voice(directory: Path, state: dict[str, torch.Tensor]) -> Path:
    """The published files; weights kept in float32 here so tests compare exactly (the loader casts)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(published_config(), indent=2))
    write_sharded(directory, state, SHARD_BYTES)
    write_tokenizer(directory)
    return directory

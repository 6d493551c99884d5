"""A tiny random Step-Audio 2 mini written the way stepfun-ai/Step-Audio-2-mini is published:
config.json (`model_type: step_audio_2`, `architectures`, `auto_map`, `text_config`,
`audio_encoder_config`, transformers 4.x `rope_theta` / `torch_dtype`), sharded safetensors with
`model.safetensors.index.json` under `model.*` / `lm_head.*` / `encoder.*` / `adapter.*`, and a
Qwen2 byte-level tokenizer whose added tokens sit at the published ids (<|BOT|> / <|EOT|> at the
preset's). Tests load it back through the real loader."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llm_stage.models.step_audio2_lm import SPEECH_CODES, SpecialIds, StepAudio2LM, tiny_config, tiny_step_audio2
from tests.sharded_safetensors import write_sharded

REPO_ID = "stepfun-ai/Step-Audio-2-mini"
SHARD_BYTES = 24 * 2**20  # small shards, so the index and more than one file are exercised


def step_audio2_model(seed: int = 0) -> StepAudio2LM:
    torch.manual_seed(seed)
    return tiny_step_audio2().eval()


def special_tokens(ids: SpecialIds = SpecialIds()) -> dict[str, int]:
    """The framing tokens at their ids and <audio_0> .. <audio_6561> after the first."""
    named = {SpecialIds.NAMES[name]: getattr(ids, name) for name in SpecialIds.NAMES}
    named.update({f"<audio_{n}>": ids.first_audio + n for n in range(SPEECH_CODES + 1)})
    return named


def step_audio2_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen2-style byte-level BPE (one token per byte) plus the added tokens."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = special_tokens()
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|EOT|>", pad_token="<|EOT|>")


def published_config() -> dict:
    config = tiny_config()
    text = dict(config["text_config"])
    config.update(
        text_config=text, torch_dtype="bfloat16", transformers_version="4.49.0",
        auto_map={
            "AutoConfig": "configuration_step_audio_2.StepAudio2Config",
            "AutoModelForCausalLM": "modeling_step_audio_2.StepAudio2ForCausalLM",
        },
    )  # fmt: skip
    return config


def write_step_audio2(directory: Path, model: StepAudio2LM) -> Path:
    """The published files; weights kept in float32 here so tests compare exactly (the loader casts)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(published_config(), indent=2))
    write_sharded(directory, model.state_dict(), SHARD_BYTES)
    step_audio2_tokenizer().save_pretrained(str(directory))
    return directory

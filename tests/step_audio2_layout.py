"""A tiny random Step-Audio 2 mini written the way stepfun-ai/Step-Audio-2-mini is published:
config.json (`model_type: step_audio_2`, `architectures`, `auto_map`, `text_config`,
`audio_encoder_config`, transformers 4.x `rope_theta` / `torch_dtype`), sharded safetensors with
`model.safetensors.index.json` under `model.*` / `lm_head.*` / `encoder.*` / `adapter.*`, and a
Qwen2 byte-level tokenizer whose added tokens sit at the published ids (<|BOT|> / <|EOT|> at the
preset's), and its `token2wav/` detokenizer (`flow.pt`, `hift.pt` with weight_g / weight_v; the ONNX
speaker model and speech tokenizer beside them are not written: nothing here runs them). Tests load
it back through the real loaders."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from detok_stage.flow.step_audio2_config import tiny_token2wav_config
from detok_stage.flow.step_audio2_model import FLOW_FILE, HIFT_FILE, StepAudio2Token2Wav
from llm_stage.models.step_audio2_lm import SPEECH_CODES, SpecialIds, StepAudio2LM, tiny_config, tiny_step_audio2
from tests.sharded_safetensors import write_sharded

REPO_ID = "stepfun-ai/Step-Audio-2-mini"
TOKEN2WAV_DIR = "token2wav"
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


def token2wav_model(seed: int = 0) -> StepAudio2Token2Wav:
    """The `step-audio2-tiny` preset's detokenizer weights for `seed` (what `ModelConfig(seed=...)` builds)."""
    return StepAudio2Token2Wav.seeded(tiny_token2wav_config(), seed)


def write_token2wav(directory: Path, model: StepAudio2Token2Wav) -> Path:
    """`flow.pt` and `hift.pt` under the published names (HiFT's weight norm as weight_g / weight_v)."""
    directory.mkdir(parents=True, exist_ok=True)
    flow, hift = model.published_state()
    torch.save(flow, directory / FLOW_FILE)
    torch.save(hift, directory / HIFT_FILE)
    return directory


def write_step_audio2(directory: Path, model: StepAudio2LM, token2wav: StepAudio2Token2Wav | None = None) -> Path:
    """The published files; weights kept in float32 here so tests compare exactly (the loader casts).
    `token2wav/` holds `token2wav` (the seed-0 preset detokenizer by default)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(published_config(), indent=2))
    write_sharded(directory, model.state_dict(), SHARD_BYTES)
    step_audio2_tokenizer().save_pretrained(str(directory))
    write_token2wav(directory / TOKEN2WAV_DIR, token2wav or token2wav_model())
    return directory

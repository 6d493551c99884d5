"""Step-Audio 2 mini weights at their published layout, the `step-audio2-tiny` preset, and its token ids.

The published directory (stepfun-ai/Step-Audio-2-mini) holds config.json (`model_type:
step_audio_2`, a Qwen2.5 `text_config`, an `audio_encoder_config`), sharded safetensors under
`model.*` (the Qwen2 body), `lm_head.*`, `encoder.*` and `adapter.*` (`step_audio2_encoder`), a
Qwen2 tokenizer whose added tokens frame the chat (`<|BOT|>role\\n ... <|EOT|>`), the audio
(`<audio_start>`, one `<audio_patch>` per encoder output, `<audio_end>`) and the spoken answer
(`<tts_start>`, then 1 text token : 4 speech tokens `<audio_N>` = 151696 + N, `<tts_end>`), and
token2wav/ (the detokenizer). Used by the step-audio2 adapter (`llm_stage.models.step_audio2`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2Model

from core.checkpoints import load_or_preset, load_prefixed_state
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from llm_stage.models.step_audio2_encoder import Adaptor, AudioEncoder, EncoderShape

FIELD = "model.checkpoint_dir"
PRESET_TEXT_IDS = range(1000, 1256)  # the preset's byte tokenizer: byte b is id 1000 + b
SPEECH_CODES = 6561  # CosyVoice 2's 25 Hz speech tokens; <audio_6561> is the interleave's audio padding
TEXT_CONFIG_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "hidden_act",
)  # fmt: skip


@dataclass(frozen=True)
class SpecialIds:
    """The ids of the tokens that frame a prompt and an answer. A checkpoint's come from its tokenizer
    by name (`from_tokenizer`); the defaults are the published ids where the public code states them
    (audio framing, tts markers, the first speech token) and the preset's own for <|BOT|> / <|EOT|>."""

    bot: int = 151664  # <|BOT|>
    eot: int = 151665  # <|EOT|>: ends a turn and the answer
    audio_start: int = 151688  # <audio_start>: the published forward splices audio after it
    audio_end: int = 151689  # <audio_end>
    audio_patch: int = 151690  # <audio_patch>: one per embedding the encoder gives
    tts_start: int = 151693  # <tts_start>: the assistant answers in speech (interleaved)
    tts_end: int = 151694  # <tts_end>
    tts_pad: int = 151695  # <tts_pad>: a text slot of the interleave with no text left
    first_audio: int = 151696  # <audio_0>

    NAMES = {
        "bot": "<|BOT|>", "eot": "<|EOT|>", "audio_start": "<audio_start>", "audio_end": "<audio_end>",
        "audio_patch": "<audio_patch>", "tts_start": "<tts_start>", "tts_end": "<tts_end>",
        "tts_pad": "<tts_pad>", "first_audio": "<audio_0>",
    }  # fmt: skip

    @classmethod
    def from_vocab(cls, vocab: dict[str, int]) -> SpecialIds:
        missing = [name for name in cls.NAMES.values() if name not in vocab]
        if missing:
            raise InvalidArgumentError(FIELD, f"the tokenizer lacks Step-Audio 2's tokens {missing}")
        return cls(**{f.name: vocab[cls.NAMES[f.name]] for f in fields(cls)})

    def speech_code(self, token: int) -> int | None:
        """The speech code of an output id (0..6560), or None for text / control ids and the audio padding."""
        code = token - self.first_audio
        return code if 0 <= code < SPEECH_CODES else None

    def is_text(self, token: int) -> bool:
        """Text the client reads: ids below the audio framing, but the chat markers."""
        return token < self.audio_start and token not in (self.bot, self.eot)


class StepAudio2LM(nn.Module):
    """The published module tree: `model` (Qwen2 body), `lm_head`, `encoder`, `adapter`."""

    def __init__(self, text_config: Qwen2Config, encoder_shape: EncoderShape) -> None:
        super().__init__()
        if encoder_shape.llm_dim != text_config.hidden_size:
            raise InvalidArgumentError(
                FIELD, f"audio_encoder_config.llm_dim {encoder_shape.llm_dim} != hidden_size {text_config.hidden_size}"
            )
        self.text_config, self.encoder_shape = text_config, encoder_shape
        self.model = Qwen2Model(text_config)
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        self.encoder = AudioEncoder(encoder_shape)
        self.adapter = Adaptor(encoder_shape)


def qwen_config(text: dict) -> Qwen2Config:
    """The Qwen2 body of a `text_config` (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
    kept = {k: text[k] for k in TEXT_CONFIG_KEYS if k in text}
    rope = text.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(text.get("rope_theta", 1e6))}
    return Qwen2Config(**kept, rope_parameters=rope, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)


def tiny_config() -> dict:
    """The step-audio2-tiny config.json: the published vocabulary and token layout, toy widths."""
    return {
        "architectures": ["StepAudio2ForCausalLM"],
        "model_type": "step_audio_2",
        "torch_dtype": "float32",
        "text_config": {
            "vocab_size": 158720, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_attention_groups": 2, "num_key_value_heads": 2,
            "max_position_embeddings": 16384, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        },
        "audio_encoder_config": {
            "n_mels": 128, "n_audio_ctx": 1500, "n_audio_state": 32, "n_audio_head": 2, "n_audio_layer": 2,
            "n_codebook_size": 4096, "llm_dim": 64, "kernel_size": 3, "adapter_stride": 2,
        },
    }  # fmt: skip


def build_from_config(config: dict) -> StepAudio2LM:
    text, audio = config.get("text_config"), config.get("audio_encoder_config")
    if not isinstance(text, dict) or not isinstance(audio, dict):
        raise InvalidArgumentError(FIELD, "config.json needs text_config and audio_encoder_config")
    return StepAudio2LM(qwen_config(text), EncoderShape.from_config(audio))


def tiny_step_audio2() -> StepAudio2LM:
    """Random weights, the LM's wider than HF's init so greedy picks are not near-ties; its head's rows
    but the ids its byte tokenizer spells, the speech ids and <|EOT|> shrunk a thousandfold, so the
    preset answers in text and speech as the real model does (not in ids nothing can spell)."""
    model = build_from_config(tiny_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and not name.startswith(("encoder.", "adapter.")):
                p.normal_(0, 0.2)
        ids, spoken = SpecialIds(), torch.zeros(model.text_config.vocab_size, dtype=torch.bool)
        spoken[PRESET_TEXT_IDS.start : PRESET_TEXT_IDS.stop] = True
        spoken[ids.first_audio : ids.first_audio + SPEECH_CODES] = True
        spoken[ids.eot] = True
        model.lm_head.weight[~spoken] *= 1e-3
    return model


def is_step_audio2_config(config: dict) -> bool:
    return config.get("model_type") == "step_audio_2" or "StepAudio2ForCausalLM" in config.get("architectures", [])


def load_published(directory: Path) -> StepAudio2LM:
    """config.json + every weight from the (sharded) safetensors, under the published names."""
    path = directory / "config.json"
    if not path.is_file():
        raise InvalidArgumentError(FIELD, f"{directory} has no config.json")
    model = build_from_config(json.loads(path.read_text()))
    state = load_prefixed_state(directory, "")
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a shape mismatch
        raise InvalidArgumentError(FIELD, f"{directory} does not fit config.json: {err}") from None
    if missing or unexpected:
        raise InvalidArgumentError(FIELD, f"{directory}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    return model


def load_step_audio2(config: ModelConfig) -> StepAudio2LM:
    """The published directory (a path or repo id in the local HF cache) or the seeded tiny preset."""
    model = load_or_preset(config.checkpoint_dir, load=load_published, preset=tiny_step_audio2, seed=config.seed)
    return model.to(config.device, getattr(torch, config.dtype)).eval()

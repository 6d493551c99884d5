"""CosyVoice 2 LM weights (`Qwen2LM` of the published code) under their published state-dict names,
the `cosyvoice2-tiny` random preset, and the published `CosyVoice2-0.5B` directory: `cosyvoice2.yaml`
(HyperPyYAML, read as plain data), `llm.pt` (the LM's state dict) and the `CosyVoice-BlankEN` Qwen
folder (config.json + tokenizer), and the kinds of positions (`Kind`: which table embeds them). Used by
the cosyvoice2 adapter (`llm_stage.models.cosyvoice2`) and its bistream layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from core.checkpoints import load_or_preset
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.hyperpyyaml import Tagged, load_data, resolve_ref
from core.messages import SamplingParams

SPEECH_TOKEN_SIZE = 6561  # FSQ codes of speech_tokenizer_v2, 25 per second
SPEECH_VOCAB = SPEECH_TOKEN_SIZE + 3  # rows of speech_embedding / llm_decoder: codes + 3 stop ids
SOS, TASK_ID = 0, 1  # rows of llm_embedding
YAML_FILE, LLM_FILE, QWEN_DIR = "cosyvoice2.yaml", "llm.pt", "CosyVoice-BlankEN"
FIELD = "model.checkpoint_dir"
# The markers CosyVoice 2's text tokenizer adds to the Qwen tokenizer, in its order (their ids follow from it).
TEXT_SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]",
    "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]",
    "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip


class Kind:
    """Second lane of a position: which embedding table its id indexes."""

    TEXT = 0  # the text to speak (Qwen's embed_tokens); its length sets the min / max output length
    PROMPT_TEXT = 1  # a voice's transcript (Qwen's embed_tokens too), not counted in the text length
    SPEECH = 2  # a speech token (speech_embedding): a voice's prompt tokens and every generated one
    LLM = 3  # sos / task_id (llm_embedding)


class QwenBody(nn.Module):
    """Holds the Qwen2ForCausalLM as `model`, so state-dict keys read `llm.model.model.layers.N...` as published."""

    def __init__(self, qwen: Qwen2ForCausalLM) -> None:
        super().__init__()
        self.model = qwen


class CosyVoice2LM(nn.Module):
    """The LM's weights under their published names: llm_embedding, llm.model.*, llm_decoder, speech_embedding."""

    def __init__(self, qwen_config: Qwen2Config) -> None:
        super().__init__()
        hidden = qwen_config.hidden_size
        self.llm_embedding = nn.Embedding(2, hidden)
        self.llm = QwenBody(Qwen2ForCausalLM(qwen_config))
        self.llm_decoder = nn.Linear(hidden, SPEECH_VOCAB)
        self.speech_embedding = nn.Embedding(SPEECH_VOCAB, hidden)

    @property
    def qwen(self) -> Qwen2ForCausalLM:
        return self.llm.model


def tiny_qwen_config() -> Qwen2Config:
    """The cosyvoice2-tiny body: Qwen2.5's layout (q/k/v bias, tied embeddings) at toy width."""
    return Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def tiny_cosyvoice2_lm() -> CosyVoice2LM:
    """Random weights, wider than HF's init so greedy picks are not near-ties."""
    model = CosyVoice2LM(tiny_qwen_config())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model


def load_cosyvoice2_lm(config: ModelConfig) -> CosyVoice2LM:
    """A published CosyVoice2-0.5B directory (a path or repo id in the local HF cache) or the tiny preset."""
    model = load_or_preset(config.checkpoint_dir, load=load_published_lm, preset=tiny_cosyvoice2_lm, seed=config.seed)
    return model.to(config.device, getattr(torch, config.dtype)).eval()


def load_published_lm(directory: Path) -> CosyVoice2LM:
    """The Qwen body from `CosyVoice-BlankEN/config.json`, every weight from `llm.pt`."""
    settings = read_published_settings(directory)
    qwen_config = Qwen2Config.from_pretrained(str(_required(directory / QWEN_DIR)), local_files_only=True)
    if qwen_config.hidden_size != settings.llm_input_size:
        raise InvalidArgumentError(
            FIELD, f"{QWEN_DIR} has hidden size {qwen_config.hidden_size}; {YAML_FILE} says {settings.llm_input_size}"
        )
    model = CosyVoice2LM(qwen_config)
    state = torch.load(_required(directory / LLM_FILE), map_location="cpu", weights_only=True)
    load_published_state(model, state, directory / LLM_FILE)
    return model


def load_published_state(model: CosyVoice2LM, state: dict[str, torch.Tensor], source: Path) -> None:
    """`state` into `model` by its published key names; only Qwen's own (tied, unused) lm_head may be absent."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a shape mismatch
        raise InvalidArgumentError(FIELD, f"{source} does not fit the LM: {err}") from None
    missing = [key for key in missing if key != "llm.model.lm_head.weight"]
    if missing or unexpected:
        raise InvalidArgumentError(FIELD, f"{source}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")


def _required(path: Path) -> Path:
    if not path.exists():
        raise InvalidArgumentError(FIELD, f"{path.parent} has no {path.name} (not a CosyVoice2-0.5B directory)")
    return path


@dataclass(frozen=True)
class PublishedSettings:
    """What the LM takes from cosyvoice2.yaml."""

    llm_input_size: int
    sampling_fields: dict[str, Any]  # its ras_sampling arguments as SamplingParams fields


def read_published_settings(directory: Path) -> PublishedSettings:
    """The `llm:` section of cosyvoice2.yaml: a Qwen2LM over 6561 speech tokens, sampled by ras_sampling."""
    path = _required(directory / YAML_FILE)
    top = load_data(path.read_text())
    llm = top.get("llm") if isinstance(top, dict) else None
    if not isinstance(llm, Tagged) or not llm.tag.endswith(".Qwen2LM") or not isinstance(llm.value, dict):
        raise InvalidArgumentError(FIELD, f"{path}: `llm` is not a Qwen2LM (CosyVoice 2)")
    fields = {key: resolve_ref(top, value) for key, value in llm.value.items()}
    if fields.get("speech_token_size") != SPEECH_TOKEN_SIZE:
        raise InvalidArgumentError(FIELD, f"{path}: speech_token_size is {fields.get('speech_token_size')}")
    sampling = fields.get("sampling")
    if not isinstance(sampling, Tagged) or not sampling.tag.endswith("ras_sampling"):
        raise InvalidArgumentError(FIELD, f"{path}: llm.sampling is not ras_sampling")
    args = {key: resolve_ref(top, value) for key, value in (sampling.value or {}).items()}
    names = {"top_p": "top_p", "top_k": "top_k", "win_size": "ras_window", "tau_r": "ras_tau"}
    return PublishedSettings(int(fields["llm_input_size"]), {names[k]: v for k, v in args.items() if k in names})


def published_sampling(default: SamplingParams, settings: PublishedSettings) -> SamplingParams:
    """`default` with the yaml's ras_sampling arguments (those it names; the rest are ras_sampling's defaults)."""
    try:
        return SamplingParams.resolve(settings.sampling_fields, default)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(FIELD, f"{YAML_FILE}: llm.{err.field}: {err.message}") from None

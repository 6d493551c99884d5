"""Each family's preset at its published size, for `loadtest.family_gpu_bench` (random weights, no checkpoint).

Every family's `<family>-tiny` preset is built from module-level config functions (`csm.tiny_csm_config`,
`dia.tiny_dia_config`, ...). `published_shapes(entry)` swaps those for the published configurations for one
block, the way `loadtest.gpu_bench.orpheus_3b_presets` does for Orpheus, so the engines, codecs and
pipelines run unchanged. Where a published size is known in code it comes from there: transformers'
config defaults are the published checkpoints' (CsmConfig = sesame/csm-1b with kyutai/mimi, DiaConfig =
Dia-1.6B, DacConfig = descript/dac_44khz, XcodecConfig = hf-audio/xcodec), VoxRay's own
`chatterbox_t3.llama_520m_config` / `T3Layout()`, `flow.config.full_s3gen_config` and the 12 Hz decoder's
`DECODER_DEFAULTS`; the Qwen bodies (Qwen2.5-0.5B, Qwen3-1.7B, the Qwen3-TTS talkers) are written out
below from their published config.json files.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from transformers import CsmConfig, DacConfig, DiaConfig, MimiConfig, Qwen2Config, Qwen3Config, XcodecConfig

import core.checkpoints as checkpoints
import detok_stage.codecs.dac_codec as dac_codec
import detok_stage.codecs.hf_codec as hf_codec
import detok_stage.codecs.mimi_codec as mimi_codec
import detok_stage.codecs.qwen3_tts_codec as qwen3_tts_codec
import detok_stage.codecs.s3gen_codec as s3gen_codec
import detok_stage.codecs.xcodec_codec as xcodec_codec
import llm_stage.models.chatterbox as chatterbox
import llm_stage.models.chatterbox_t3 as chatterbox_t3
import llm_stage.models.cosyvoice2_lm as cosyvoice2_lm
import llm_stage.models.csm as csm
import llm_stage.models.dia as dia
import llm_stage.models.parallel_heads as parallel_heads
import llm_stage.models.qwen3_tts as qwen3_tts
from detok_stage.codecs.qwen3_tts_decoder import DECODER_DEFAULTS
from detok_stage.flow.config import full_s3gen_config

QWEN_TEXT_VOCAB = 151936  # Qwen2.5 / Qwen3 tokenizers' embedding rows


@dataclass(frozen=True)
class FamilyEntry:
    """One bench entry: the served preset it patches, whether it runs CFG, and its published sizes."""

    key: str  # the entry's name in the report
    model: str  # the registry's preset name (`<family>-tiny`)
    patches: Callable[[], list[tuple[ModuleType, str, Any]]]  # (module, attribute, published value)
    sizes: dict[str, Any] = field(default_factory=dict)  # stated in the JSON
    guided: bool = False  # Dia and Chatterbox serve every stream as a CFG pair


def mimi_published(num_quantizers: int) -> dict:
    return {**MimiConfig().to_dict(), "num_quantizers": num_quantizers, "use_cache": True}


def csm_published(num_codebooks: int = 32) -> CsmConfig:
    """sesame/csm-1b: Llama-1B backbone (16 layers, 2048 wide), 4-layer depth decoder, 32 Mimi codebooks."""
    config = CsmConfig()
    config.codec_config = MimiConfig(**mimi_published(config.num_codebooks))
    return config


def dia_published(*_args, **_kwargs) -> DiaConfig:
    """Dia-1.6B: 12-layer encoder (1024), 18-layer decoder (2048), 9 DAC channels, delays [0, 8..15]."""
    return DiaConfig()


def dac_published(*_args, **_kwargs) -> DacConfig:
    """descript/dac_44khz: hop 512, 9 x 1024 codebooks, 1536-wide decoder."""
    return DacConfig(sampling_rate=44100)


def qwen3_tts_published(talker_hidden: int, talker_ffn: int) -> Callable[..., dict]:
    """Qwen3-TTS-12Hz-{0.6B,1.7B}: a 28-layer Qwen3 talker (1024 / 2048 wide) over 16 codebooks of 2048,
    a 5-layer 1024-wide code predictor; field names as in `qwen3_tts.tiny_qwen3_tts_config`."""

    def build(*_args, **_kwargs) -> dict:
        config = copy.deepcopy(TINY_QWEN3_TTS)
        codebook = 2048
        talker = config["talker_config"]
        shift = codebook - 64  # the tiny config's special ids sit above its 64 codes: move them above 2048
        for name, value in list(talker.items()):
            if name.startswith("codec_") and isinstance(value, int):
                talker[name] = value + shift
        talker["codec_language_id"] = {k: v + shift for k, v in talker["codec_language_id"].items()}
        talker["spk_id"] = {k: v + shift for k, v in talker["spk_id"].items()}
        talker.update(
            vocab_size=codebook + qwen3_tts.NUM_SPECIAL_CODEC_IDS, hidden_size=talker_hidden,
            intermediate_size=talker_ffn, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, rope_scaling={"interleaved": True, "mrope_section": [24, 20, 20]},
            text_vocab_size=QWEN_TEXT_VOCAB, text_hidden_size=2048, num_code_groups=16,
        )  # fmt: skip
        talker["code_predictor_config"].update(
            vocab_size=codebook, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_code_groups=16,
        )  # fmt: skip
        return config

    return build


TINY_QWEN3_TTS = qwen3_tts.tiny_qwen3_tts_config()


def qwen3_tts_decoder_published(*_args, **_kwargs) -> dict:
    """Qwen3-TTS-Tokenizer-12Hz's decoder: the reference defaults (8-layer 1024-wide windowed transformer,
    16 x 2048 codebooks, 1536-wide upsampler, 1920x to 24 kHz)."""
    return {**qwen3_tts_codec.tiny_tokenizer_config(), "decoder_config": dict(DECODER_DEFAULTS)}


def qwen25_05b(*_args, **_kwargs) -> Qwen2Config:
    """Qwen2.5-0.5B (CosyVoice-BlankEN, CosyVoice2-0.5B's LM body): 24 layers, 896 wide, 14 / 2 heads."""
    return Qwen2Config(
        vocab_size=QWEN_TEXT_VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def qwen3_17b(*_args, **_kwargs) -> Qwen3Config:
    """Qwen3-1.7B: 28 layers, 2048 wide, 16 / 8 heads of 128 (the parallel-heads body at Bagpiper's class)."""
    return Qwen3Config(
        vocab_size=QWEN_TEXT_VOCAB, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=1, eos_token_id=3,
    )  # fmt: skip


def xcodec_published(*_args, **_kwargs) -> XcodecConfig:
    """hf-audio/xcodec at 4 kbps: 8 quantizers x 1024 codes, hop 320 at 16 kHz."""
    return XcodecConfig(target_bandwidths=[4.0])


def s3gen_published(**overrides) -> Any:
    """CosyVoice2-0.5B / chatterbox S3Gen (flow ~100M + HiFT ~20M), 25-token chunks, 10 ODE steps."""
    return full_s3gen_config(**{"chunk_tokens": s3gen_codec.STREAM_CHUNK_TOKENS, **overrides})


ENTRIES: tuple[FamilyEntry, ...] = (
    FamilyEntry("csm-1b", "csm-tiny", lambda: [
        (csm, "tiny_csm_config", csm_published), (csm, "tiny_mimi_config", mimi_published),
        (mimi_codec, "tiny_mimi_config", mimi_published)],
        {"backbone": "Llama 16 layers x 2048", "depth_decoder": "4 layers x 1024, 31 steps per frame",
         "codebooks": 32, "codec": "Mimi 24 kHz 12.5 Hz (MimiConfig defaults)"}),
    FamilyEntry("dia-1.6b", "dia-tiny", lambda: [
        (dia, "tiny_dia_config", dia_published), (dac_codec, "tiny_dac_config", dac_published)],
        {"encoder": "12 layers x 1024", "decoder": "18 layers x 2048", "channels": 9, "delays": [0, *range(8, 16)],
         "codec": "DAC 44.1 kHz, hop 512"}, guided=True),
    FamilyEntry("qwen3-tts-0.6b", "qwen3-tts-tiny", lambda: [
        (qwen3_tts, "tiny_qwen3_tts_config", qwen3_tts_published(1024, 3072)),
        (qwen3_tts_codec, "tiny_tokenizer_config", qwen3_tts_decoder_published)],
        {"talker": "Qwen3 28 layers x 1024", "code_predictor": "5 layers x 1024, 15 steps per frame",
         "codebooks": 16, "codec": "12 Hz decoder (DECODER_DEFAULTS), 24 kHz"}),
    FamilyEntry("qwen3-tts-1.7b", "qwen3-tts-tiny", lambda: [
        (qwen3_tts, "tiny_qwen3_tts_config", qwen3_tts_published(2048, 6144)),
        (qwen3_tts_codec, "tiny_tokenizer_config", qwen3_tts_decoder_published)],
        {"talker": "Qwen3 28 layers x 2048", "code_predictor": "5 layers x 1024, 15 steps per frame",
         "codebooks": 16, "codec": "12 Hz decoder (DECODER_DEFAULTS), 24 kHz"}),
    FamilyEntry("cosyvoice2-0.5b", "cosyvoice2-tiny", lambda: [
        (cosyvoice2_lm, "tiny_qwen_config", qwen25_05b), (s3gen_codec, "served_tiny_s3gen_config", s3gen_published)],
        {"lm": "Qwen2.5-0.5B 24 layers x 896", "speech_vocab": 6564,
         "codec": "S3Gen (full_s3gen_config): flow 10 ODE steps + HiFT, 24 kHz"}),
    FamilyEntry("chatterbox", "chatterbox-tiny", lambda: [
        (chatterbox_t3, "tiny_llama_config", chatterbox_t3.llama_520m_config),
        (chatterbox_t3, "TINY_LAYOUT", chatterbox_t3.T3Layout()),
        (s3gen_codec, "served_tiny_s3gen_config", s3gen_published)],
        {"t3": "Llama_520M 30 layers x 1024 (llama_520m_config)", "speech_vocab": 8194,
         "codec": "S3Gen (full_s3gen_config), 24 kHz"}, guided=True),
    FamilyEntry("parallel-heads-1.7b", "parallel-heads-tiny", lambda: [
        (parallel_heads, "tiny_qwen3_config", qwen3_17b), (xcodec_codec, "tiny_xcodec_config", xcodec_published)],
        {"body": "Qwen3-1.7B 28 layers x 2048", "streams": 8, "codebook": 1024,
         "codec": "X-Codec 16 kHz, hop 320 (XcodecConfig defaults, 4 kbps)"}),
)  # fmt: skip
ENTRY_NAMES = tuple(entry.key for entry in ENTRIES)


def entry_named(key: str) -> FamilyEntry:
    for entry in ENTRIES:
        if entry.key == key:
            return entry
    raise ValueError(f"unknown family entry {key!r}; valid: {', '.join(ENTRY_NAMES)}")


@contextmanager
def patched(module: ModuleType, name: str, value: Any) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextmanager
def published_shapes(entry: FamilyEntry) -> Iterator[None]:
    """`entry.model`'s preset at the published sizes, for this block only."""
    with patched_all(entry.patches()):
        yield


# --- random weights made on the device: seconds at 1-2B where a float32 CPU init takes about a minute --------

PRESET_USERS = (csm, dia, qwen3_tts, cosyvoice2_lm, parallel_heads, mimi_codec, hf_codec, qwen3_tts_codec)


def made_on(device: str, build: Callable[[], Any]) -> Any:
    """`build()` with its modules created on `device`; on the CPU where a preset's init refuses that."""
    try:
        with torch.device(device):
            return build()
    except (RuntimeError, TypeError) as err:  # e.g. a CPU generator used under the device context
        print(f"  preset {getattr(build, '__name__', build)} not built on {device} ({err!r:.160}): on the CPU")
        return build()


def presets_on(device: str) -> list[tuple[ModuleType, str, Any]]:
    """Patches that make every family's preset (`load_or_preset`'s `preset`, chatterbox's `tiny_t3`) on `device`;
    only the module construction moves, so tensors the adapters make later stay where their code puts them."""

    def load_or_preset(directory, *, load, preset, seed, **kwargs):
        return checkpoints.load_or_preset(
            directory, load=load, preset=lambda: made_on(device, preset), seed=seed, **kwargs
        )

    patches = [(module, "load_or_preset", load_or_preset) for module in PRESET_USERS]
    return [*patches, (chatterbox, "tiny_t3", functools.partial(made_on, device, chatterbox.tiny_t3))]


@contextmanager
def patched_all(patches: list[tuple[ModuleType, str, Any]]) -> Iterator[None]:
    with ExitStack() as stack:
        for module, name, value in patches:
            stack.enter_context(patched(module, name, value))
        yield

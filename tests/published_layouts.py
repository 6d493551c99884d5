"""Tiny random models written in the exact layouts their publishers use on the Hugging Face hub
(file names, sharded safetensors with their index, config fields, tokenizer files, weight key
names), and a local HF cache laid out the way `hf download` leaves it. Tests load them back
through the real loaders and compare with the same models built in memory."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from snac import SNAC
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    CsmForConditionalGeneration,
    CsmProcessor,
    DacFeatureExtractor,
    DacModel,
    DiaFeatureExtractor,
    DiaForConditionalGeneration,
    DiaTokenizer,
    EncodecFeatureExtractor,
    LlamaConfig,
    LlamaForCausalLM,
    MimiConfig,
    MimiModel,
    PreTrainedTokenizerFast,
    Qwen2ForCausalLM,
    XcodecModel,
)

from detok_stage.codecs.dac_codec import tiny_dac_config
from detok_stage.codecs.mimi_codec import tiny_mimi_config, with_random_codebooks
from detok_stage.codecs.qwen3_tts_codec import preset_decoder, tiny_tokenizer_config
from detok_stage.codecs.qwen3_tts_decoder import Qwen3TTSDecoder
from detok_stage.codecs.snac_codec import TINY_SNAC
from detok_stage.codecs.xcodec_codec import tiny_xcodec_config
from llm_stage.models.chatterbox_t3 import T3, T3Voice
from llm_stage.models.cosyvoice2_lm import CosyVoice2LM, tiny_cosyvoice2_lm
from llm_stage.models.csm import tiny_csm_config
from llm_stage.models.dia import tiny_dia_config
from llm_stage.models.orpheus import VOCAB_SIZE
from llm_stage.models.qwen3_tts import SPEAKERS, tiny_qwen3_tts_config
from llm_stage.models.qwen3_tts_talker import Qwen3TTSModel, TalkerSpec

ORPHEUS_REPO, SNAC_REPO = "canopylabs/orpheus-3b-0.1-ft", "hubertsiuzdak/snac_24khz"
CSM_REPO, MIMI_REPO = "sesame/csm-1b", "kyutai/mimi"
DIA_REPO, DAC_REPO = "nari-labs/Dia-1.6B-0626", "descript/dac_44khz"
QWEN3_TTS_REPO = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tts_pad>": 151671,
                 "<tts_text_bos>": 151672, "<tts_text_eod>": 151673}  # fmt: skip
LLAMA3_SPECIALS = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eot_id|>": 128009}
CSM_SPECIALS = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|AUDIO|>": 128002, "<|audio_eos|>": 128003}
# CsmProcessor's chat template as sesame/csm-1b ships it, reduced to its framing (written here, not copied):
# per turn BOS, "[speaker]", the text, EOS, then an audio placeholder when the turn carries audio.
CSM_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- bos_token }}{{- '[' + message['role'] + ']' }}"
    "{{- message['content'][0]['text'] }}{{- eos_token }}"
    "{%- if message['content']|length > 1 %}{{- '<|AUDIO|><|audio_eos|>' }}{%- endif %}{%- endfor %}"
)


def seeded(seed: int) -> None:
    torch.manual_seed(seed)


def llama3_tokenizer(specials: dict[str, int], template: str) -> PreTrainedTokenizerFast:
    """A Llama-3-style byte-level BPE (no merges: one token per byte) with the special tokens at their
    Llama 3 ids and a TemplateProcessing post-processor (`template`, e.g. "BOS $A" or "BOS $A EOS")."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    ids = [(t, specials[t]) for t in ("<|begin_of_text|>", "<|end_of_text|>")]
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=ids)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|end_of_text|>"
    )


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    tokenizer.save_pretrained(str(directory))
    specials = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}
    (directory / "special_tokens_map.json").write_text(json.dumps(specials))


def as_transformers4_config(directory: Path) -> None:
    """Rewrite config.json the way the published checkpoints have it (saved by transformers 4.x):
    `rope_theta` + `rope_scaling` instead of v5's `rope_parameters`, `torch_dtype` instead of `dtype`,
    in nested sub-configs too."""

    def legacy(config: dict) -> dict:
        out = {}
        for key, value in config.items():
            if key == "rope_parameters" and isinstance(value, dict):
                rope = dict(value)
                out["rope_theta"] = rope.pop("rope_theta", 10000.0)
                out["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
            elif key == "dtype":
                out["torch_dtype"] = value
            else:
                out[key] = legacy(value) if isinstance(value, dict) else value
        return out

    path = directory / "config.json"
    path.write_text(json.dumps({**legacy(json.loads(path.read_text())), "transformers_version": "4.51.3"}, indent=2))


def orpheus_llama(seed: int = 0) -> LlamaForCausalLM:
    """Orpheus 3B's config.json fields (Llama 3.2 body, llama3 rope, tied embeddings, 156940-token vocab),
    at toy width; weights rounded to bf16 as published."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000, eos_token_id=128009, rms_norm_eps=1e-5, dtype="bfloat16",
    )  # fmt: skip
    seeded(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            p.copy_(p.to(torch.bfloat16))  # parameters only: rotary buffers stay float32, as on load
    return model


def write_orpheus(directory: Path, model: LlamaForCausalLM) -> Path:
    """canopylabs/orpheus-3b-0.1-ft: config.json, generation_config.json, model-0000k-of-00002.safetensors +
    model.safetensors.index.json (bf16), tokenizer.json / tokenizer_config.json / special_tokens_map.json."""
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(str(directory), max_shard_size="12MB")
    _save_tokenizer(llama3_tokenizer(LLAMA3_SPECIALS, "<|begin_of_text|>:0 $A:0"), directory)
    as_transformers4_config(directory)
    return directory


def snac_published_config() -> dict:
    """hubertsiuzdak/snac_24khz's config.json at toy width (noise on, as published)."""
    return {**TINY_SNAC, "noise": True}


def snac_model(seed: int = 0) -> SNAC:
    seeded(seed)
    return SNAC(**snac_published_config()).eval()


def write_snac(directory: Path, model: SNAC) -> Path:
    """config.json + pytorch_model.bin with the old weight-norm keys (`weight_g` / `weight_v`) the
    published file has (torch's current weight_norm saves `parametrizations.weight.original0/1`)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(snac_published_config()))
    renamed = {
        key.replace(".parametrizations.weight.original0", ".weight_g").replace(
            ".parametrizations.weight.original1", ".weight_v"
        ): value
        for key, value in model.state_dict().items()
    }
    torch.save(renamed, directory / "pytorch_model.bin")
    return directory


def csm_model(seed: int = 0) -> CsmForConditionalGeneration:
    """sesame/csm-1b's config fields (Llama 3 text vocab and special ids, Mimi codec_config) at toy size."""
    config = tiny_csm_config()
    for name, value in {
        "text_vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": None, "pad_token_id": 128002,
        "audio_token_id": 128002, "audio_eos_token_id": 128003,
    }.items():  # fmt: skip
        setattr(config, name, value)
    seeded(seed)
    model = CsmForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    with_random_codebooks(model.codec_model)  # (a published Mimi's codebooks are not zeros)
    return model


def write_csm(directory: Path, model: CsmForConditionalGeneration) -> Path:
    """Model (sharded safetensors, `codec_model.*` holding Mimi), generation config, the Llama 3 tokenizer
    with sesame's BOS $A EOS post-processor, and CsmProcessor's files (chat template, feature extractor)."""
    model.save_pretrained(str(directory), max_shard_size="10MB")
    tokenizer = llama3_tokenizer(CSM_SPECIALS, "<|begin_of_text|>:0 $A:0 <|end_of_text|>:0")
    extractor = EncodecFeatureExtractor(feature_size=1, sampling_rate=24000)
    CsmProcessor(extractor, tokenizer, chat_template=CSM_CHAT_TEMPLATE).save_pretrained(str(directory))
    as_transformers4_config(directory)
    return directory


def mimi_model(seed: int = 0) -> MimiModel:
    seeded(seed)
    return with_random_codebooks(MimiModel(MimiConfig(**tiny_mimi_config(8)))).eval()


def write_mimi(directory: Path, model: MimiModel) -> Path:
    """kyutai/mimi: config.json, model.safetensors, preprocessor_config.json."""
    model.save_pretrained(str(directory))
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000).save_pretrained(str(directory))
    return directory


def dia_model(seed: int = 0) -> DiaForConditionalGeneration:
    seeded(seed)
    model = DiaForConditionalGeneration(tiny_dia_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model


def write_dia(directory: Path, model: DiaForConditionalGeneration) -> Path:
    """nari-labs/Dia-1.6B-0626 (transformers format): config.json, model.safetensors,
    generation_config.json, the byte-level DiaTokenizer's files and preprocessor_config.json."""
    model.save_pretrained(str(directory))
    DiaTokenizer().save_pretrained(str(directory))
    DiaFeatureExtractor().save_pretrained(str(directory))
    as_transformers4_config(directory)
    return directory


def dac_model(seed: int = 0) -> DacModel:
    seeded(seed)
    model = DacModel(tiny_dac_config()).eval()
    with torch.no_grad():
        model.decoder.conv2.weight.mul_(50.0)
    return model


def write_dac(directory: Path, model: DacModel) -> Path:
    """descript/dac_44khz: config.json, model.safetensors, preprocessor_config.json."""
    model.save_pretrained(str(directory))
    DacFeatureExtractor(sampling_rate=44100, hop_length=512).save_pretrained(str(directory))
    return directory


def xcodec_model(seed: int = 0) -> XcodecModel:
    seeded(seed)
    return XcodecModel(tiny_xcodec_config()).eval()


def write_xcodec(directory: Path, model: XcodecModel) -> Path:
    """hf-audio/xcodec-*: config.json, model.safetensors, preprocessor_config.json (DAC's extractor)."""
    model.save_pretrained(str(directory))
    DacFeatureExtractor(sampling_rate=16000, hop_length=320).save_pretrained(str(directory))
    return directory


def qwen2_tokenizer(words: tuple[str, ...] = ("assistant",)) -> PreTrainedTokenizerFast:
    """A Qwen2-style byte-level BPE: one token per byte but `words` (merged whole, as Qwen's vocab has
    "assistant"), the special tokens at their Qwen ids, no BOS / EOS added."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    for word in words:
        for i in range(1, len(word)):
            merges.append((word[:i], word[i]))
            vocab.setdefault(word[: i + 1], len(vocab))
    vocab.update(QWEN_SPECIALS)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def qwen3_tts_config() -> dict:
    """Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice's config.json fields (special text and codec ids, speakers,
    dialects, mrope, the 2048 + 1024 codec vocab) at toy widths."""
    config = tiny_qwen3_tts_config(num_codebooks=4, codebook_size=2048)
    talker = config["talker_config"]
    codec_ids = {"codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
                 "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157}  # fmt: skip
    talker.update(codec_ids)
    talker.update({
        "text_vocab_size": 151936, "text_hidden_size": 16, "position_id_per_seconds": 13, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "attention_bias": False, "use_sliding_window": False,
        "rope_scaling": {"interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"},
        "codec_language_id": {"chinese": 2055, "english": 2050, "beijing_dialect": 2074, "sichuan_dialect": 2062},
        "spk_id": {name: 3000 + i for i, name in enumerate(SPEAKERS)},
    })  # fmt: skip
    talker["code_predictor_config"]["vocab_size"] = 2048
    return {
        **config, "architectures": ["Qwen3TTSForConditionalGeneration"], "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": "0b6", "im_start_token_id": 151644, "im_end_token_id": 151645, "tts_pad_token_id": 151671,
        "tts_bos_token_id": 151672, "tts_eos_token_id": 151673, "speaker_encoder_config": {"enc_dim": 64},
        "torch_dtype": "bfloat16", "transformers_version": "4.57.3",
    }  # fmt: skip


def qwen3_tts_model(seed: int = 0) -> Qwen3TTSModel:
    """The talker + code predictor of `qwen3_tts_config`, weights wide enough for distinct greedy picks,
    rounded to bf16 as published."""
    seeded(seed)
    model = Qwen3TTSModel(TalkerSpec.from_config(qwen3_tts_config())).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            p.copy_(p.to(torch.bfloat16))
    return model


def qwen3_tts_tokenizer_model(seed: int = 0) -> Qwen3TTSDecoder:
    seeded(seed)
    return preset_decoder(tiny_tokenizer_config(num_quantizers=4, codebook_size=2048))[0].eval()


def write_qwen3_tts(directory: Path, model: Qwen3TTSModel, decoder: Qwen3TTSDecoder) -> Path:
    """Qwen/Qwen3-TTS-12Hz-*-CustomVoice: config.json, generation_config.json, model.safetensors (`talker.*`,
    bf16), the Qwen2 tokenizer, and speech_tokenizer/ (config.json, preprocessor_config.json,
    model.safetensors with the Mimi-style `encoder.*` the decoder does not use, and `decoder.*`)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(qwen3_tts_config(), indent=2))
    generation = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
                  "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0,
                  "subtalker_top_k": 50, "max_new_tokens": 8192}  # fmt: skip
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    talker = {f"talker.{k}": v.to(torch.bfloat16).contiguous() for k, v in model.talker.state_dict().items()}
    save_file(talker, str(directory / "model.safetensors"), metadata={"format": "pt"})
    qwen2_tokenizer().save_pretrained(str(directory))
    codec = directory / "speech_tokenizer"
    codec.mkdir()
    config = {**tiny_tokenizer_config(num_quantizers=4, codebook_size=2048), "encoder_valid_num_quantizers": 16,
              "input_sample_rate": 24000, "encode_downsample_rate": 1920, "architectures": ["Qwen3TTSTokenizerV2Model"],
              "encoder_config": {"model_type": "mimi", "num_quantizers": 32, "codebook_dim": 256}}  # fmt: skip
    (codec / "config.json").write_text(json.dumps(config, indent=2))
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000).save_pretrained(str(codec))
    weights = {f"decoder.{k}": v.contiguous() for k, v in decoder.state_dict().items()}
    weights["encoder.quantizer.semantic_residual_vector_quantizer.layers.0.codebook.embed_sum"] = torch.zeros(8, 4)
    save_file(weights, str(codec / "model.safetensors"), metadata={"format": "pt"})
    return directory


def put_in_hf_cache(cache: Path, repo_id: str, source: Path, commit: str = "0123456789abcdef" * 2 + "01234567") -> Path:
    """Lay `source`'s files out as the hub cache does: blobs by hash, a snapshot of relative symlinks,
    refs/main naming the commit. Returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


# ---- CosyVoice 2 (FunAudioLLM/CosyVoice2-0.5B): the LM's files ---------------------------------------------------

COSYVOICE2_REPO = "FunAudioLLM/CosyVoice2-0.5B"
QWEN25_ADDED_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen2.5's first added tokens, in id order
# cosyvoice2.yaml's structure as published (HyperPyYAML: !apply / !new / !name / !ref), reduced to the fixed
# params, the llm section and the head of the flow section; written here, not copied.
COSYVOICE2_YAML = """\
__set_seed1: !apply:random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]

sample_rate: 24000
llm_input_size: {hidden}
llm_output_size: {hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25

llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {top_p}
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    vocab_size: 6561
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: 512
        num_blocks: 6

allowed_special: 'all'
"""


def qwen_tokenizer_files(directory: Path) -> None:
    """A Qwen2-style byte-level BPE as Qwen publishes its tokenizer (vocab.json, merges.txt,
    tokenizer_config.json with the added specials after the vocab), at toy size."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("Ġ", "t")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    added = {
        str(len(vocab) + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True}
        for i, t in enumerate(QWEN25_ADDED_TOKENS)
    }  # fmt: skip
    config = {
        "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": list(QWEN25_ADDED_TOKENS[1:]),
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
        "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def cosyvoice2_lm(seed: int = 0) -> CosyVoice2LM:
    seeded(seed)
    return tiny_cosyvoice2_lm()


def write_cosyvoice2_lm(directory: Path, model: CosyVoice2LM, top_p: float = 0.8) -> Path:
    """FunAudioLLM/CosyVoice2-0.5B's LM files: cosyvoice2.yaml, llm.pt (the Qwen2LM state dict: llm_embedding,
    llm.model.model.*, llm.model.lm_head, llm_decoder, speech_embedding), CosyVoice-BlankEN/ (Qwen config.json
    in transformers-4 fields, generation_config.json, its own blank weights in model.safetensors, which llm.pt
    replaces, and the tokenizer files)."""
    directory.mkdir(parents=True, exist_ok=True)
    hidden = model.qwen.config.hidden_size
    (directory / "cosyvoice2.yaml").write_text(COSYVOICE2_YAML.format(hidden=hidden, top_p=top_p))
    torch.save(model.state_dict(), directory / "llm.pt")
    blank = directory / "CosyVoice-BlankEN"
    seeded(12345)
    Qwen2ForCausalLM(model.qwen.config).save_pretrained(str(blank))
    as_transformers4_config(blank)
    qwen_tokenizer_files(blank)
    return directory


# ---- Chatterbox (ResembleAI/chatterbox): the T3 files --------------------------------------------------------------

CHATTERBOX_REPO = "ResembleAI/chatterbox"


def chatterbox_tokenizer() -> Tokenizer:
    """Chatterbox's English text vocabulary layout at toy size: [STOP] = 0 and [START] = 255 (T3's stop /
    start text ids), the other markers among the low ids, characters in between; spaces arrive as [SPACE]."""
    specials = {"[STOP]": 0, "[UNK]": 1, "[SPACE]": 2, "[PAD]": 3, "[SEP]": 4, "[CLS]": 5, "[MASK]": 6, "[START]": 255}
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-"
    vocab = {**specials, **{ch: 7 + i for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def write_chatterbox_lm(directory: Path, model: T3, voice: T3Voice) -> Path:
    """ResembleAI/chatterbox's LM files: t3_cfg.safetensors (the T3 state dict), conds.pt (the built-in voice:
    `t3` = T3Cond's fields, `gen` = S3Gen's reference dict, here a stand-in), tokenizer.json."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "t3_cfg.safetensors"))
    t3 = {
        "speaker_emb": voice.speaker_emb.view(1, -1), "clap_emb": None,
        "cond_prompt_speech_tokens": voice.prompt_speech.view(1, -1), "cond_prompt_speech_emb": None,
        "emotion_adv": torch.full((1, 1, 1), 0.5),
    }  # fmt: skip
    tokens = voice.prompt_speech.view(1, -1)  # S3Gen's reference dict (s3gen.embed_ref), as published
    gen = {"prompt_token": tokens, "prompt_token_len": torch.tensor([tokens.shape[1]]),
           "prompt_feat": torch.zeros(1, 2 * tokens.shape[1], 80), "prompt_feat_len": None,
           "embedding": torch.zeros(1, 192)}  # fmt: skip
    torch.save({"t3": t3, "gen": gen}, directory / "conds.pt")
    chatterbox_tokenizer().save(str(directory / "tokenizer.json"))
    return directory

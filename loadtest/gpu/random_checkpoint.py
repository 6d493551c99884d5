"""Random-weight checkpoints in the published Orpheus 3B and SNAC 24 kHz layouts, for a GPU machine with no weights.

`write_checkpoints(out, ...)` writes OUT/orpheus (config.json as transformers 4.x saved canopylabs/orpheus-3b-0.1-ft,
sharded bf16 safetensors + index, a Llama-3-style byte-level tokenizer with Orpheus' special ids) and OUT/snac
(hubertsiuzdak/snac_24khz: config.json + pytorch_model.bin with weight-norm `weight_g` / `weight_v` keys), the
LM's weights made on the device in bf16 (seconds for 3B on a GPU). `voxray serve --model OUT/orpheus --codec
OUT/snac` and `loadtest.gpu.inprocess_sweep` load them through VoxRay's own loaders; loadtest/gpu/sweep_run.sh
calls this first. `--small` writes the orpheus-tiny body and the tiny SNAC (a CPU rehearsal).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from snac import SNAC
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from core.config import ModelConfig
from detok_stage.codecs.snac_codec import TINY_SNAC
from llm_stage.models.orpheus import tiny_llama_config
from loadtest.gpu_bench import SNAC_24KHZ, llama_3b_config, random_llama_on_device

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
LLAMA3_IDS = {BOS: 128000, EOS: 128001, EOT: 128009}
# Orpheus' added tokens: `<custom_token_N>` at 128256 + N; 1..10 are its control tokens (start of speech 128257,
# end of speech 128258, start / end of human 128259 / 128260, start of AI 128261, ...), the rest audio codes.
NUM_CONTROL_TOKENS = 10
SHARD_SIZE = "2GB"  # the published 3B checkpoint comes in two shards; toy bodies stay one file


def orpheus_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges (one token per byte), Llama 3's BOS / EOS / EOT and Orpheus' control tokens
    at their published ids; encoding prepends BOS, as Llama 3's post-processor does."""
    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = dict(LLAMA3_IDS)
    specials.update({f"<custom_token_{n}>": 128256 + n for n in range(1, NUM_CONTROL_TOKENS + 1)})
    backend = Tokenizer(models.BPE(vocab={**vocab, **specials}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS}:0 $A:0", special_tokens=[(BOS, 128000)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=EOS)


def legacy_config_fields(config: dict) -> dict:
    """config.json as transformers 4.x wrote it: `rope_theta` + `rope_scaling`, `torch_dtype` (nested too)."""
    out: dict = {}
    for key, value in config.items():
        if key == "rope_parameters" and isinstance(value, dict):
            rope = dict(value)
            out["rope_theta"] = rope.pop("rope_theta", 10000.0)
            out["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
        elif key == "dtype":
            out["torch_dtype"] = value
        else:
            out[key] = legacy_config_fields(value) if isinstance(value, dict) else value
    return out


def orpheus_body(num_layers: int, small: bool) -> LlamaConfig:
    """Orpheus 3B's Llama body (or orpheus-tiny's width with Llama 3's rope, `small`) at `num_layers`."""
    if not small:
        return llama_3b_config(num_layers)
    config = tiny_llama_config(max_positions=131072)  # Llama 3's rope scaling is set for long contexts
    config.num_hidden_layers = num_layers
    config.rope_parameters = llama_3b_config(1).rope_parameters
    return config


def random_orpheus(body: LlamaConfig, device: str, seed: int) -> LlamaForCausalLM:
    """Seeded random weights made on `device` in bf16 (the published dtype)."""
    config = ModelConfig(name="orpheus-tiny", device=device, dtype="bfloat16", seed=seed)
    return random_llama_on_device(config, body)


def write_orpheus_dir(directory: Path, model: LlamaForCausalLM) -> Path:
    """The model's weights (bf16, sharded with an index past SHARD_SIZE), its config in the 4.x form, the tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(directory), max_shard_size=SHARD_SIZE)
    config_path = directory / "config.json"
    fields = legacy_config_fields(json.loads(config_path.read_text()))
    config_path.write_text(json.dumps({**fields, "transformers_version": "4.51.3"}, indent=2))
    tokenizer = orpheus_tokenizer()
    tokenizer.save_pretrained(str(directory))
    names = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}
    (directory / "special_tokens_map.json").write_text(json.dumps(names))
    return directory


def random_snac(config: dict, seed: int) -> SNAC:
    torch.manual_seed(seed)
    return SNAC(**config).eval()


def write_snac_dir(directory: Path, model: SNAC, config: dict) -> Path:
    """config.json (constructor kwargs) + pytorch_model.bin keyed as published: torch's current weight norm
    names `parametrizations.weight.original0 / 1`, the published file the older `weight_g / weight_v`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    published = {}
    for key, value in model.state_dict().items():
        key = key.replace(".parametrizations.weight.original0", ".weight_g")
        published[key.replace(".parametrizations.weight.original1", ".weight_v")] = value.detach().cpu()
    torch.save(published, directory / "pytorch_model.bin")
    return directory


def folder_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def write_checkpoints(out: Path, num_layers: int, device: str, small: bool = False, seed: int = 0) -> dict:
    """OUT/orpheus and OUT/snac; returns what was written, its size and the seconds it took."""
    start = time.perf_counter()
    model = random_orpheus(orpheus_body(num_layers, small), device, seed)
    orpheus_dir = write_orpheus_dir(out / "orpheus", model)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    snac_config = {**TINY_SNAC, "noise": True} if small else SNAC_24KHZ
    snac_dir = write_snac_dir(out / "snac", random_snac(snac_config, seed), snac_config)
    return {"orpheus_dir": str(orpheus_dir), "snac_dir": str(snac_dir), "num_layers": num_layers, "small": small,
            "llm_params": num_params, "orpheus_gb": round(folder_bytes(orpheus_dir) / 1e9, 3),
            "snac_mb": round(folder_bytes(snac_dir) / 1e6, 1), "device": device,
            "write_s": round(time.perf_counter() - start, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="writes OUT/orpheus and OUT/snac")
    p.add_argument("--layers", type=int, default=28, help="Llama layers (28 = Orpheus 3B; fewer for a rehearsal)")
    p.add_argument("--device", default="cuda", help="where the LM's random weights are made")
    p.add_argument("--small", action="store_true", help="orpheus-tiny width and the tiny SNAC (CPU rehearsal)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    written = write_checkpoints(args.out, args.layers, args.device, args.small, args.seed)
    print(json.dumps(written), flush=True)
    return written


if __name__ == "__main__":
    main()

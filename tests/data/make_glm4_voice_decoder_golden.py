"""Regenerate `tests/data/glm4_voice_decoder_golden.npz`: mels and audio of the reference GLM-4-Voice
decoder (THUDM/GLM-4-Voice's `flow_inference.AudioDecoder`: CosyVoice 1 flow + HiFT) on the tiny
layout of `tests/glm4_voice_decoder_layout.py` (seeded weights, seed 3), for a few token sequences,
whole (`offline_inference`) and in blocks streamed as `web_demo.py` streams them (every earlier token
as prompt_token, every earlier returned mel as prompt_feat, one uuid's caches, the last block final).

The reference is not installed: extract it OUTSIDE the repo, with Matcha-TTS at the submodule's
commit and the reference's pure-Python requirements in a folder of its own, and name that folder:

    git -C <GLM-4-Voice clone> archive <commit> cosyvoice flow_inference.py | tar -x -C /tmp/glmref
    git -C <Matcha-TTS clone> archive dd9105b34bf2 matcha | tar -x -C /tmp/glmref
    pip install --no-deps --target /tmp/glmref/site diffusers==0.27.2 einops HyperPyYAML==1.2.2 \
        omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 scipy ruamel.yaml
    python -m tests.data.make_glm4_voice_decoder_golden /tmp/glmref <commit> \
        tests/data/glm4_voice_decoder_golden.npz

in the repo's venv, on CPU (the reference seeds torch's CPU generator with 42 before each flow call:
its flow noise, then HiFT's phases and source noise, are what our decoder draws). Stubbed, as the
decoder does not use them: torchaudio (audio I/O) and `conformer` (imported by Matcha's decoder
module for a block the estimator does not build), `matcha.utils` (its
`__init__` pulls in hydra / lightning; the CFM only takes `get_pylogger`), and huggingface_hub's old
`cached_download`. The reference loads the written config.yaml with
HyperPyYAML itself, so the layout is checked too.

Eval mode: the reference's `AudioDecoder` builds the modules from the yaml and never calls `eval()`,
so its flow runs in training mode: the encoder's dropout (rate 0.1 in CosyVoice 1's config, assumed
here) is live, drawn from torch's global generator (the first call before any seeding, later ones
continuing the seed-42 stream of the call before). We decode in eval mode, and make the goldens with
the reference's modules in eval mode too: the computation the decoder was trained for, reproducible.
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

SEED = 3
CASES = [  # name, tokens (seeded draw of this length), the streamed blocks' sizes
    ("short", 20, (8, 12)),
    ("three_blocks", 30, (6, 10, 14)),
]


def case_tokens(length: int, index: int) -> list[int]:
    gen = torch.Generator().manual_seed(100 + index)
    return torch.randint(0, 16384, (length,), generator=gen).tolist()


def stub_modules() -> None:
    for name in ("torchaudio", "conformer"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.ConformerBlock = torch.nn.Module  # subclassed by a wrapper the estimator does not build
        sys.modules[name] = module
    for name in ("matcha.utils", "matcha.utils.pylogger"):  # the package imports hydra / lightning / rich
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name == "matcha.utils")
        module.get_pylogger = logging.getLogger
        sys.modules[name] = module
    import huggingface_hub  # diffusers 0.27 imports a helper newer huggingface_hub dropped; unused here

    if not hasattr(huggingface_hub, "cached_download"):
        huggingface_hub.cached_download = None


def reference_streamed(decoder, tokens: list[int], blocks: tuple[int, ...]):
    """web_demo.py's loop over fixed blocks: -> (waves, mels) per block."""
    prompt_feat = torch.zeros(1, 0, 80)
    prompt_token = torch.zeros(1, 0, dtype=torch.int64)
    waves, mels, start = [], [], 0
    for i, size in enumerate(blocks):
        block = torch.tensor(tokens[start : start + size])[None]
        if mels:
            prompt_feat = torch.cat(mels, dim=-1).transpose(1, 2)
        wave, mel = decoder.token2wav(block, uuid="golden", prompt_token=prompt_token, prompt_feat=prompt_feat,
                                      finalize=i == len(blocks) - 1)  # fmt: skip
        waves.append(wave[0].clone())
        mels.append(mel)
        prompt_token = torch.cat([prompt_token, block], dim=-1)
        start += size
    return waves, [m[0] for m in mels]


def main(reference_dir: str, commit: str, out: str) -> None:
    root = Path(reference_dir).resolve()
    sys.path[:0] = [str(root), str(root / "site")]
    stub_modules()
    from flow_inference import AudioDecoder

    from detok_stage.flow.glm_config import tiny_glm4_decoder_config
    from detok_stage.flow.glm_model import GLM4Decoder
    from tests.glm4_voice_decoder_layout import write_glm4_voice_decoder

    directory = write_glm4_voice_decoder(Path(tempfile.mkdtemp()), GLM4Decoder.seeded(tiny_glm4_decoder_config(), SEED))
    decoder = AudioDecoder(str(directory / "config.yaml"), str(directory / "flow.pt"), str(directory / "hift.pt"),
                           device="cpu")  # fmt: skip
    decoder.flow.eval()  # AudioDecoder never calls eval(): see the module docstring
    decoder.hift.eval()
    arrays: dict[str, np.ndarray] = {"reference": np.array(f"THUDM/GLM-4-Voice@{commit} + Matcha-TTS@dd9105b")}
    with torch.inference_mode():  # web_demo runs under no_grad; torch >= 2.4 refuses
        # fade_in_out's in-place update of the flow's inference-mode output outside inference mode
        for index, (name, length, blocks) in enumerate(CASES):
            add_case(decoder, arrays, index, name, length, blocks)
    np.savez_compressed(out, **arrays)
    print({k: v.shape for k, v in arrays.items()})


def add_case(decoder, arrays: dict, index: int, name: str, length: int, blocks: tuple[int, ...]) -> None:
    tokens = case_tokens(length, index)
    assert sum(blocks) == length
    arrays[f"{name}_tokens"] = np.array(tokens)
    arrays[f"{name}_blocks"] = np.array(blocks)
    wave, mel = decoder.token2wav(torch.tensor(tokens)[None], uuid="offline", finalize=True)
    arrays[f"{name}_offline_wave"] = wave[0].numpy()
    arrays[f"{name}_offline_mel"] = mel[0].numpy()
    waves, mels = reference_streamed(decoder, tokens, blocks)
    for i, (w, m) in enumerate(zip(waves, mels, strict=True)):
        arrays[f"{name}_block{i}_wave"] = w.numpy()
        arrays[f"{name}_block{i}_mel"] = m.numpy()


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""Regenerate tests/data/glm4_voice_tokenizer_golden.npz: GLM-4-Voice's reference speech tokenizer run on
the tiny published layout (`tests/glm4_voice_tokenizer_layout.py`, seed 0): token ids of four clips
(1.3 s, 4.7 s, 11.2 s and 41.3 s, the last cut into two 30 s windows) and the pooled encoder outputs
before the quantizer of the first window of each.

Reference: THUDM/GLM-4-Voice at eb00ce9, its `speech_tokenizer/` package (WhisperVQEncoder,
`utils.extract_speech_token`) and transformers' WhisperFeatureExtractor, run on the CPU in this
project's venv (transformers 5.24). Extract it outside the repo and point REF_DIR at it:

    mkdir -p /work/scratch/glm-tok-ref && cd /work/scratch/glm-tok-ref
    git -C /work/.mirror/THUDM+GLM-4-Voice/repo archive HEAD speech_tokenizer | tar x
    cd - && REF_DIR=/work/scratch/glm-tok-ref .venv/bin/python tests/data/make_glm4_voice_tokenizer_golden.py

The reference files are not edited; this script only stands in, before importing them, for what
transformers 5 dropped or the encoder path never uses: `transformers.modeling_attn_mask_utils`
(decoder-only), `speech_tokenizer.generation_whisper` (decoder generation), `torchaudio` (clips are
passed as (tensor, 16000), so neither load nor resampling runs), and `Tensor.cuda` as the identity and
the feature extractor's `device="cuda"` as "cpu" (`extract_speech_token` moves everything to CUDA). The
model is loaded as web_demo.py does (`WhisperVQEncoder.from_pretrained`, eager attention).
tests/llm_stage/test_glm4_voice_tokenizer.py checks ours against the file without the reference.
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).with_name("glm4_voice_tokenizer_golden.npz")
LAYOUT_SEED, AUDIO_SEED = 0, 7
CLIP_SECONDS = (1.3, 4.7, 11.2, 41.3)
NUM_VALUES = 8  # encoder outputs kept per window: the first few of every channel would bloat the file


def clips() -> list[torch.Tensor]:
    """Harmonics with a moving pitch plus noise, deterministic, one per duration."""
    gen = torch.Generator().manual_seed(AUDIO_SEED)
    out = []
    for seconds in CLIP_SECONDS:
        t = torch.arange(round(seconds * 16_000)) / 16_000
        pitch = 140.0 + 60.0 * torch.sin(2 * torch.pi * 0.7 * t)
        phase = 2 * torch.pi * torch.cumsum(pitch, 0) / 16_000
        tone = sum(torch.sin(k * phase) / k for k in (1, 2, 3, 5))
        envelope = 0.5 + 0.5 * torch.sin(2 * torch.pi * 2.3 * t).abs()
        out.append(0.2 * envelope * tone + 0.02 * torch.randn(t.shape, generator=gen))
    return out


def stand_ins() -> None:
    torchaudio = types.ModuleType("torchaudio")
    torchaudio.transforms = types.SimpleNamespace(Resample=None)  # named in a type annotation only
    sys.modules["torchaudio"] = torchaudio
    masks = types.ModuleType("transformers.modeling_attn_mask_utils")
    masks.AttentionMaskConverter = None
    sys.modules["transformers.modeling_attn_mask_utils"] = masks
    generation = types.ModuleType("speech_tokenizer.generation_whisper")
    generation.WhisperGenerationMixin = type("WhisperGenerationMixin", (), {})
    sys.modules["speech_tokenizer.generation_whisper"] = generation
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self


class OnCpu:
    """The feature extractor with `device="cuda"` (its argument and BatchFeature.to) kept on the CPU."""

    def __init__(self, extractor) -> None:
        self.extractor, self.hop_length = extractor, extractor.hop_length

    def __call__(self, *args, **kwargs):
        features = self.extractor(*args, **(kwargs | {"device": "cpu"}))
        features.to = lambda *a, **k: features
        return features


def reference_tokens(layout: Path, waves: list[torch.Tensor]) -> tuple[list[list[int]], list[np.ndarray]]:
    from transformers import WhisperFeatureExtractor

    sys.path.insert(0, os.environ["REF_DIR"])
    stand_ins()
    from speech_tokenizer import utils
    from speech_tokenizer.modeling_whisper import WhisperVQEncoder

    del sys.modules["torchaudio"]  # transformers asks importlib about it later

    model = WhisperVQEncoder.from_pretrained(str(layout), attn_implementation="eager").eval()
    extractor = OnCpu(WhisperFeatureExtractor.from_pretrained(str(layout)))
    pooled: list[torch.Tensor] = []
    model.pooling_layer.register_forward_hook(lambda _m, _i, out: pooled.append(out.transpose(1, 2)))
    batched = utils.extract_speech_token(model, extractor, [(w[None], 16_000) for w in waves])
    alone = [utils.extract_speech_token(model, extractor, [(w[None], 16_000)])[0] for w in waves]
    assert batched == alone, "a clip's tokens depend on its batch: pick other durations (see the test)"
    firsts = pooled[-len(waves) :]  # the alone runs, first window of each clip
    return batched, [f[0, :, :NUM_VALUES].numpy() for f in firsts]


def main() -> None:
    from tests.glm4_voice_tokenizer_layout import write_glm4_voice_tokenizer

    waves = clips()
    with tempfile.TemporaryDirectory() as tmp:
        layout = write_glm4_voice_tokenizer(Path(tmp) / "tok", seed=LAYOUT_SEED)
        tokens, pooled = reference_tokens(layout, waves)
    arrays = {f"tokens_{i}": np.asarray(t, dtype=np.int64) for i, t in enumerate(tokens)}
    arrays |= {f"pooled_{i}": p.astype(np.float32) for i, p in enumerate(pooled)}
    arrays["clip_seconds"] = np.asarray(CLIP_SECONDS)
    np.savez_compressed(OUT, **arrays)
    print(OUT, {k: v.shape for k, v in arrays.items()})


if __name__ == "__main__":
    main()

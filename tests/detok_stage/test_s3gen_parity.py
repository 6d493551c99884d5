"""Our S3Gen detokenizer (flow + HiFT) against chatterbox-tts's on the same seeded tiny weights.

The goldens in `tests/data/s3gen_golden.npz` were made by `loadtest/golden/make_s3gen_golden.py`
in a scratch venv with the reference installed (its version is stored in the file); here the same
weights are rebuilt from their names, so CI needs no reference.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from detok_stage.flow.config import tiny_s3gen_config
from detok_stage.flow.flow import CausalMaskedDiffWithXvec, Conditioning
from detok_stage.flow.hift import HiFTGenerator
from detok_stage.flow.weights import load_seeded, parity_inputs

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "s3gen_golden.npz"
FLOW_SEED, HIFT_SEED = 11, 12  # as in make_s3gen_golden.py


@functools.cache
def golden() -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN))


def test_golden_names_its_reference():
    assert str(golden()["reference"]).startswith("chatterbox-tts==")


@pytest.mark.parametrize("label, chunk", [("chunked", tiny_s3gen_config().chunk_tokens), ("full", 0)])
def test_flow_mel_matches_reference(label, chunk):
    cfg = tiny_s3gen_config(chunk_tokens=chunk)
    flow = load_seeded(CausalMaskedDiffWithXvec(cfg), FLOW_SEED).eval()
    prompt, prompt_mel, xvector, tokens = parity_inputs()
    mel = flow.inference(tokens[None], Conditioning(prompt, prompt_mel, xvector))[0]
    want = torch.from_numpy(golden()[f"mel_{label}"])
    assert mel.shape == want.shape == (80, 2 * tokens.numel())
    torch.testing.assert_close(mel, want, atol=2e-4, rtol=1e-4)


def test_chunk_masks_change_the_mel():
    """The chunked and full-attention goldens differ, so each test above checks its own masks."""
    assert np.abs(golden()["mel_chunked"] - golden()["mel_full"]).max() > 1e-2


def test_hift_wave_matches_reference():
    cfg = tiny_s3gen_config()
    hift = load_seeded(HiFTGenerator(cfg.hift, cfg.nsf_seed), HIFT_SEED).eval()
    mel = torch.from_numpy(golden()["mel_chunked"])[None]
    wave = hift.inference(mel)[0]
    want = torch.from_numpy(golden()["wave_chunked"])
    assert wave.shape == want.shape == (mel.shape[2] * 480,)
    assert want.abs().max() > 0.05  # not a silent golden
    torch.testing.assert_close(wave, want, atol=2e-4, rtol=1e-4)

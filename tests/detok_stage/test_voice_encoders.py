"""Our S3 speech tokenizer v2, CAM++ and their front ends against the reference packages' outputs
(tests/data/voice_encoders_golden.npz, made by tests/data/make_voice_encoders_golden.py with the
same seeded random weights), plus the resampler and the whole voice encoding."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from detok_stage.flow.weights import load_seeded
from detok_stage.voice.campplus import CAMPPlus, tiny_campplus_config
from detok_stage.voice.encoder import VoiceEncoder
from detok_stage.voice.features import kaldi_fbank, resample, s3gen_mel, whisper_log_mel
from detok_stage.voice.s3tokenizer import S3TokenizerV2, tiny_s3tokenizer_config

GOLDEN = Path(__file__).parents[1] / "data" / "voice_encoders_golden.npz"


def _golden_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN.with_name("make_voice_encoders_golden.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN)), _golden_module()


def test_golden_names_its_reference(golden):
    data, _ = golden
    assert "s3tokenizer==0.3.0" in str(data["reference"]) and "chatterbox-tts==0.1.7" in str(data["reference"])


def test_front_ends_match_the_references(golden):
    data, make = golden
    wave_16k, wave_24k = make.clips()
    # (1e-4: the FFT's rounding differs by CPU; one bin of 38400 was 4e-5 off on one machine of this kind)
    torch.testing.assert_close(whisper_log_mel(wave_16k), torch.from_numpy(data["log_mel"]), atol=1e-4, rtol=0)
    torch.testing.assert_close(kaldi_fbank(wave_16k), torch.from_numpy(data["fbank"]), atol=5e-4, rtol=1e-4)
    torch.testing.assert_close(s3gen_mel(wave_24k), torch.from_numpy(data["prompt_mel"]), atol=1e-5, rtol=0)


def test_speech_tokenizer_matches_the_reference(golden):
    data, make = golden
    wave_16k, _ = make.clips()
    ours = load_seeded(S3TokenizerV2(tiny_s3tokenizer_config()), make.TOKENIZER_SEED).eval()
    mel = torch.from_numpy(data["log_mel"])[None]
    with torch.inference_mode():
        hidden, lengths = ours.encoder(mel, torch.tensor([mel.shape[-1]]))
    torch.testing.assert_close(hidden[0], torch.from_numpy(data["hidden"]), atol=1e-4, rtol=1e-4)
    tokens = ours.tokenize(wave_16k)
    assert tokens.tolist() == data["tokens"].tolist()
    assert tokens.numel() == 75 and int(tokens.min()) >= 0 and int(tokens.max()) < 6561  # 3 s at 25 Hz


def test_campplus_matches_the_reference(golden):
    data, make = golden
    wave_16k, _ = make.clips()
    ours = load_seeded(CAMPPlus(tiny_campplus_config()), make.SPEAKER_SEED).eval()
    torch.testing.assert_close(ours.embed(wave_16k), torch.from_numpy(data["xvector"]), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(("from_hz", "to_hz"), [(48_000, 16_000), (16_000, 24_000), (22_050, 16_000), (44_100, 24_000)])
def test_resample_keeps_a_tone_and_the_duration(from_hz, to_hz):
    t = torch.arange(from_hz) / from_hz
    out = resample(torch.sin(2 * math.pi * 440 * t), from_hz, to_hz)
    assert out.numel() == to_hz
    expected = torch.sin(2 * math.pi * 440 * torch.arange(to_hz) / to_hz)
    assert (out[200:-200] - expected[200:-200]).abs().max() < 2e-3


def test_voice_encoding_is_deterministic_and_sized():
    encoder = VoiceEncoder.seeded(3)
    gen = torch.Generator().manual_seed(0)
    clip = 0.1 * torch.randn(int(24_000 * 2.5), generator=gen)
    first, again = encoder.encode(clip, 24_000), encoder.encode(clip.clone(), 24_000)
    assert first.prompt_tokens.dtype == torch.long and first.prompt_mel.shape == (2 * first.prompt_tokens.numel(), 80)
    assert first.prompt_tokens.numel() == 62 and first.xvector.shape == (192,)
    assert torch.equal(first.prompt_tokens, again.prompt_tokens) and torch.equal(first.xvector, again.xvector)
    other = encoder.encode(0.1 * torch.randn(int(24_000 * 2.5), generator=gen), 24_000)
    assert not torch.allclose(first.xvector, other.xvector)


def test_encoders_load_from_a_chatterbox_s3gen_file_layout(tmp_path):
    """chatterbox's s3gen.safetensors keeps the encoders beside the flow as `tokenizer.*` and
    `speaker_encoder.*`; they load from it (here at the tiny shapes) and encode as the originals."""
    from safetensors.torch import save_file

    original = VoiceEncoder.seeded(4)
    state = {f"tokenizer.{k}": v for k, v in original.tokenizer.state_dict().items()}
    state |= {f"speaker_encoder.{k}": v for k, v in original.speaker.state_dict().items()}
    state["flow.input_embedding.weight"] = torch.zeros(2, 2)  # the rest of the file is ignored
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "s3gen.safetensors"))
    loaded = VoiceEncoder.from_checkpoint(tmp_path, tiny_s3tokenizer_config(), tiny_campplus_config())
    clip = 0.1 * torch.randn(24_000 * 2, generator=torch.Generator().manual_seed(1))
    want, got = original.encode(clip, 24_000), loaded.encode(clip, 24_000)
    assert torch.equal(want.prompt_tokens, got.prompt_tokens) and torch.equal(want.xvector, got.xvector)
    del state["tokenizer.encoder.conv1.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "s3gen.safetensors"))
    with pytest.raises(KeyError, match="conv1"):
        VoiceEncoder.from_checkpoint(tmp_path, tiny_s3tokenizer_config(), tiny_campplus_config())
    with pytest.raises(FileNotFoundError):
        VoiceEncoder.from_checkpoint(tmp_path / "missing")

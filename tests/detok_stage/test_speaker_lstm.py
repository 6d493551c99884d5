"""Our port of chatterbox's voice encoder (silence trim, 40-bin mel, LSTM windows, speaker embedding) and
T3's prompt-token cut against the reference's outputs (tests/data/speaker_lstm_golden.npz, made by
loadtest/golden/make_speaker_lstm_golden.py with the same seeded random weights), without it installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from detok_stage.flow.weights import load_seeded
from detok_stage.voice.features import speaker_mel, trim_silence
from detok_stage.voice.s3tokenizer import S3TokenizerV2, tiny_s3tokenizer_config
from detok_stage.voice.speaker_lstm import SpeakerLSTM, mel_windows, tiny_speaker_lstm_config, window_starts

REPO = Path(__file__).parents[2]
GOLDEN = REPO / "tests" / "data" / "speaker_lstm_golden.npz"


@pytest.fixture(scope="module")
def golden():
    spec = importlib.util.spec_from_file_location("make_golden", REPO / "loadtest/golden/make_speaker_lstm_golden.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    return dict(np.load(GOLDEN)), make


@pytest.fixture(scope="module")
def encoder(golden):
    _, make = golden
    return load_seeded(SpeakerLSTM(tiny_speaker_lstm_config()), make.SPEAKER_SEED).eval()


def test_golden_names_its_reference(golden):
    data, _ = golden
    assert "chatterbox-tts==0.1.7" in str(data["reference"]) and "librosa==0.11.0" in str(data["reference"])


def test_trim_and_mel_match_the_reference(golden):
    data, make = golden
    wave = make.clip()
    start, end = data["trim"].tolist()
    trimmed = trim_silence(wave, 20.0)
    assert trimmed.numel() == end - start and torch.equal(trimmed, wave[start:end])
    mel = speaker_mel(trimmed)
    want = torch.from_numpy(data["mel"])
    assert mel.shape == want.shape
    torch.testing.assert_close(mel, want, atol=1e-4, rtol=1e-4)


def test_windows_and_embedding_match_the_reference(golden, encoder):
    data, make = golden
    mel = torch.from_numpy(data["mel"])
    assert len(window_starts(mel.shape[0])) == data["windows"].shape[0]
    with torch.inference_mode():
        windows = encoder.window_embeddings(mel_windows(mel))
    torch.testing.assert_close(windows, torch.from_numpy(data["windows"]), atol=1e-5, rtol=0)
    speaker = encoder.embed(make.clip())
    torch.testing.assert_close(speaker, torch.from_numpy(data["speaker_emb"]), atol=1e-5, rtol=0)
    assert abs(float(speaker.norm()) - 1.0) < 1e-5


def test_t3_prompt_tokens_match_the_reference(golden):
    from detok_stage.voice.encoder import t3_prompt_tokens

    data, make = golden
    tokenizer = load_seeded(S3TokenizerV2(tiny_s3tokenizer_config()), make.TOKENIZER_SEED).eval()
    tokens = t3_prompt_tokens(tokenizer, make.clip())
    assert tokens.tolist() == data["t3_prompt_tokens"].tolist() and tokens.numel() == 150


def test_window_count_rule():
    assert window_starts(10) == [0]  # shorter than one window: one, zero-padded
    assert window_starts(160) == [0]
    assert window_starts(160 + 77) == [0, 77]
    assert window_starts(160 + 77 + 30) == [0, 77]  # (30 + 83) / 160 < 0.8: the tail is dropped
    assert window_starts(160 + 77 + 46) == [0, 77, 154]  # (46 + 83) / 160 >= 0.8: kept


def test_chatterbox_encoders_load_from_the_published_layout(tmp_path):
    """s3gen.safetensors (`tokenizer.*`, `speaker_encoder.*`) with ve.safetensors beside it (the voice
    encoder's own names), here at the tiny shapes: they encode as the seeded originals; without
    ve.safetensors the load fails naming it."""
    from safetensors.torch import save_file

    from detok_stage.voice.campplus import tiny_campplus_config
    from detok_stage.voice.encoder import VoiceEncoder

    original = VoiceEncoder.seeded(5, with_lm_speaker=True)
    state = {f"tokenizer.{k}": v for k, v in original.tokenizer.state_dict().items()}
    state |= {f"speaker_encoder.{k}": v for k, v in original.speaker.state_dict().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "s3gen.safetensors"))
    configs = (tiny_s3tokenizer_config(), tiny_campplus_config(), tiny_speaker_lstm_config())
    with pytest.raises(FileNotFoundError, match="ve.safetensors"):
        VoiceEncoder.from_checkpoint(tmp_path, *configs, with_lm_speaker=True)
    save_file(
        {k: v.contiguous() for k, v in original.lm_speaker.state_dict().items()}, str(tmp_path / "ve.safetensors")
    )
    loaded = VoiceEncoder.from_checkpoint(tmp_path / "s3gen.safetensors", *configs, with_lm_speaker=True)
    wave = 0.1 * torch.randn(24_000 * 2, generator=torch.Generator().manual_seed(1))
    want, got = original.encode(wave, 24_000), loaded.encode(wave, 24_000)
    assert got.lm_speaker == want.lm_speaker and len(got.lm_speaker.prompt_tokens) == 50
    assert VoiceEncoder.from_checkpoint(tmp_path, *configs).lm_speaker is None  # cosyvoice2: no T3 conditioning

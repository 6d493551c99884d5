"""GLM-4-Voice's speech tokenizer (`glm4_voice_tokenizer`): the tiny published layout tokenizes four clips
(one past 30 s) exactly as the reference does (tests/data/make_glm4_voice_tokenizer_golden.py), its
pooled encoder outputs within float rounding; our log-mel equals transformers' WhisperFeatureExtractor's;
a batch gives each clip what it gets alone; a whole-model checkpoint (`model.encoder.*`) loads the same;
bad clips are refused naming `input_audio`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import WhisperFeatureExtractor

from core.errors import InvalidArgumentError
from llm_stage.models.glm4_voice_tokenizer import (
    SpeechTokenizer,
    num_tokens,
    split_windows,
    tiny_shape,
    window_mel,
)
from tests.glm4_voice_tokenizer_layout import preprocessor_config, write_glm4_voice_tokenizer

DATA = Path(__file__).parents[1] / "data"
GOLDEN = DATA / "glm4_voice_tokenizer_golden.npz"


def golden_clips() -> list[torch.Tensor]:
    spec = importlib.util.spec_from_file_location("make_golden", DATA / "make_glm4_voice_tokenizer_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.clips()


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Path:
    return write_glm4_voice_tokenizer(tmp_path_factory.mktemp("glm4-voice-tokenizer") / "tok", seed=0)


@pytest.fixture(scope="module")
def tokenizer(layout: Path) -> SpeechTokenizer:
    return SpeechTokenizer.from_dir(layout)


def test_tokens_and_encoder_outputs_match_the_reference(tokenizer: SpeechTokenizer) -> None:
    golden = np.load(GOLDEN)
    clips = golden_clips()
    tokens = tokenizer.tokens(clips)
    for i, (clip, ids) in enumerate(zip(clips, tokens, strict=True)):
        assert ids.dtype == torch.long and ids.numel() == num_tokens(clip.numel())
        np.testing.assert_array_equal(ids.numpy(), golden[f"tokens_{i}"])
    pooled, counts = tokenizer.encode([split_windows(c)[0] for c in clips])
    for i, count in enumerate(counts.tolist()):
        expected = golden[f"pooled_{i}"]
        assert count == expected.shape[0]
        np.testing.assert_allclose(pooled[i, :count, : expected.shape[1]].numpy(), expected, atol=2e-5, rtol=0)
    assert len(set(torch.cat(tokens).tolist())) > 10  # the golden clips exercise many codes


@pytest.mark.parametrize("num_samples", [1, 1279, 1280, 16_000 + 1111, 3 * 16_000 + 640])
def test_log_mel_equals_whisper_feature_extractor(num_samples: int, tokenizer: SpeechTokenizer) -> None:
    wave = 0.1 * torch.randn(num_samples, generator=torch.Generator().manual_seed(num_samples))
    extractor = WhisperFeatureExtractor(**preprocessor_config(tokenizer.shape))
    features = extractor(
        [wave.numpy()], sampling_rate=16_000, return_attention_mask=True, return_tensors="pt",
        padding="longest", pad_to_multiple_of=tokenizer.shape.samples_per_token,
    )  # fmt: skip
    ours = window_mel(wave, tokenizer.shape)
    torch.testing.assert_close(ours, features["input_features"][0], atol=2e-6, rtol=0)
    mask = features["attention_mask"][0]
    assert int(mask[:: tokenizer.shape.samples_per_token // 160].sum()) == num_tokens(num_samples)


def test_a_batch_gives_each_clip_what_it_gets_alone(tokenizer: SpeechTokenizer) -> None:
    gen = torch.Generator().manual_seed(3)
    clips = [0.1 * torch.randn(n, generator=gen) for n in (4000, 33 * 16_000 + 5, 1280 * 7, 2 * 16_000 - 1)]
    together = tokenizer.tokens(clips)
    for clip, ids in zip(clips, together, strict=True):
        assert torch.equal(tokenizer.tokens([clip])[0], ids)
        assert 0 <= int(ids.min()) and int(ids.max()) < tokenizer.codebook_size


@pytest.mark.parametrize(
    "changes",
    [{}, {"encoder_causal_convolution": False, "quantize_causal_block_size": None, "pooling_type": "max"},
     {"quantize_causal_encoder": True}, {"pooling_position": 1}],
)  # fmt: skip
def test_every_structure_batches_as_alone(changes: dict) -> None:
    """Symmetric convs (conv2 reads zeros past a window's frames), plain causal layers, pooling mid-encoder."""
    torch.manual_seed(4)
    tokenizer = SpeechTokenizer(dataclasses.replace(tiny_shape(), **changes)).eval()
    gen = torch.Generator().manual_seed(4)
    clips = [0.1 * torch.randn(n, generator=gen) for n in (3000, 31 * 16_000, 1280 * 5 + 7)]
    together = tokenizer.tokens(clips, windows_per_forward=2)
    assert [torch.equal(tokenizer.tokens([c])[0], ids) for c, ids in zip(clips, together, strict=True)] == [True] * 3


def test_a_whole_model_checkpoint_loads_the_same(layout: Path, tokenizer: SpeechTokenizer, tmp_path: Path) -> None:
    """The full WhisperVQForConditionalGeneration names (`model.encoder.*`, layers past the quantizer,
    the final layer_norm, the decoder) as `utils.load_quantize_encoder` reads them."""
    state = {f"model.encoder.{k}": v for k, v in load_file(str(layout / "model.safetensors")).items()}
    extra = {"model.encoder.layers.9.fc1.weight": torch.ones(2, 2), "model.encoder.layer_norm.weight": torch.ones(2),
             "model.decoder.embed_tokens.weight": torch.ones(3, 2), "proj_out.weight": torch.ones(3, 2)}  # fmt: skip
    whole = tmp_path / "whole"
    whole.mkdir()
    save_file(state | extra, str(whole / "model.safetensors"))
    config = json.loads((layout / "config.json").read_text())
    (whole / "config.json").write_text(json.dumps(config | {"architectures": ["WhisperVQForConditionalGeneration"]}))
    clip = 0.1 * torch.randn(20_000, generator=torch.Generator().manual_seed(5))
    assert torch.equal(SpeechTokenizer.from_dir(whole).tokens([clip])[0], tokenizer.tokens([clip])[0])


def test_from_dir_refuses_a_front_end_it_does_not_compute(layout: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bad / name).write_bytes((layout / name).read_bytes())
    config = json.loads((layout / "preprocessor_config.json").read_text())
    (bad / "preprocessor_config.json").write_text(json.dumps(config | {"feature_size": 80}))
    with pytest.raises(ValueError, match="feature_size"):
        SpeechTokenizer.from_dir(bad)


@pytest.mark.parametrize(
    ("clip", "message"),
    [
        (torch.zeros(0), "empty"),
        (torch.zeros(2, 100), "mono"),
        (torch.tensor([0.0, float("nan"), 0.1]), "non-finite"),
        (torch.tensor([0.0, float("inf")]), "non-finite"),
        (torch.zeros(100, dtype=torch.int16), "float"),
    ],
)
def test_bad_clips_name_the_field(clip: torch.Tensor, message: str) -> None:
    tokenizer = SpeechTokenizer.preset(0)
    with pytest.raises(InvalidArgumentError, match=message) as err:
        tokenizer.tokens([clip])
    assert err.value.field == "input_audio"
    with pytest.raises(InvalidArgumentError) as err:
        tokenizer.tokens([torch.zeros(10), clip])
    assert err.value.field == "input_audio[1]"


def test_preset_tokenizes_at_12_5_hz() -> None:
    tokenizer = SpeechTokenizer.preset(1)
    assert tokenizer.sample_rate_hz == 16_000
    assert [t.numel() for t in tokenizer.tokens([torch.zeros(16_000), 0.1 * torch.ones(8_000)])] == [13, 7]
    assert tokenizer.tokens([]) == []

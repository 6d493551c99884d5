"""GLM-4-Voice's detokenizer (flow matching + HiFT at 22.05 kHz) as a stateful codec: the published
layout round trip, parity with the reference (`tests/data/glm4_voice_decoder_golden.npz`, made by
`tests/data/make_glm4_voice_decoder_golden.py` on the same seeded tiny weights) offline and streamed
in the demo's blocks, held short chunks, and token ids checked before any work."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import TokenChunk
from detok_stage.codecs.glm4_voice_codec import CacheMissError, GLM4VoiceCodec, load_published
from detok_stage.flow.glm_config import GLM4DecoderConfig, config_from_yaml_text, tiny_glm4_decoder_config
from detok_stage.flow.glm_model import GLM4Decoder
from tests.glm4_voice_decoder_layout import config_yaml, write_glm4_voice_decoder

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "glm4_voice_decoder_golden.npz"
SEED = 3  # as in make_glm4_voice_decoder_golden.py
ATOL = 1e-4  # measured: <= 7.5e-6 on audio, <= 3e-6 on mels (float32, reference on CPU)


@functools.cache
def golden() -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN))


@functools.cache
def codec() -> GLM4VoiceCodec:
    return GLM4VoiceCodec.build(ModelConfig(name="glm4-voice-tiny", seed=SEED))


def case(name: str) -> tuple[list[int], list[int]]:
    return golden()[f"{name}_tokens"].tolist(), golden()[f"{name}_blocks"].tolist()


def chunk(rid: str, seq: int, tokens: list[int], keep: tuple[int, int], final: bool, start: int = 0) -> TokenChunk:
    """A chunk keeping tokens [keep) of `tokens`, its window from `start` to the end of what it keeps."""
    return TokenChunk(rid, seq, [[t] for t in tokens[start : keep[1]]], start, keep[0], keep[1], final)


def assert_audio(got: torch.Tensor, key: str) -> None:
    want = torch.from_numpy(golden()[key])
    assert got.shape == want.shape, key
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_golden_names_its_reference():
    assert str(golden()["reference"]).startswith("THUDM/GLM-4-Voice@")


def test_published_layout_round_trip(tmp_path):
    model = GLM4Decoder.seeded(tiny_glm4_decoder_config(), SEED)
    loaded = load_published(write_glm4_voice_decoder(tmp_path, model))
    assert loaded.config == model.config
    for ours, theirs in ((model.flow, loaded.flow), (model.hift, loaded.hift)):
        for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    assert "weight_g" in "".join(torch.load(tmp_path / "hift.pt", weights_only=True))  # the published names
    built = GLM4VoiceCodec.build(ModelConfig(name="glm4-voice-tiny", codec_dir=str(tmp_path)))
    assert (built.sample_rate_hz, built.samples_per_frame, built.codebook_size) == (22050, 1764, 16384)


def test_full_config_reads_the_published_shapes():
    config = GLM4DecoderConfig()
    assert config.hift.hop == 256 and config.mel_overlap_len == 34 and config.samples_per_token == 1764
    assert config_from_yaml_text(config_yaml(config), "config.yaml", "model.codec_dir") == config


def test_config_of_another_model_names_the_field(tmp_path):
    text = config_yaml(tiny_glm4_decoder_config()).replace("flow.flow.MaskedDiffWithXvec", "flow.flow.Other")
    for name, data in (("config.yaml", text), ("flow.pt", ""), ("hift.pt", "")):
        (tmp_path / name).write_text(data)
    with pytest.raises(InvalidArgumentError) as err:
        load_published(tmp_path)
    assert err.value.field == "model.codec_dir" and "MaskedDiffWithXvec" in err.value.message


def test_offline_matches_reference():
    tokens, _ = case("short")
    wave = codec().decode(torch.tensor(tokens).view(1, -1, 1))
    assert_audio(wave[0], "short_offline_wave")
    assert golden()["short_offline_wave"].std() > 0.05  # not a silent golden


def test_streamed_blocks_match_reference_and_short_chunks_wait():
    """The demo's blocks (6, 10, 14) sent as chunks of 3 + 3, 10, 14: the first 3 are held (shorter
    than the cross-fade) and decoded with the next 3 as one block, so each block's audio is the reference's."""
    tokens, blocks = case("three_blocks")
    assert blocks == [6, 10, 14]
    cuts = [(0, 3), (3, 6), (6, 16), (16, 30)]
    chunks = [chunk("a", i, tokens, cut, i == len(cuts) - 1) for i, cut in enumerate(cuts)]
    out = codec().decode_stream(chunks)
    assert out[0].numel() == 0
    for block, audio in enumerate(out[1:]):
        assert_audio(audio, f"three_blocks_block{block}_wave")
    assert codec().cache_bytes("a") == 0  # the final chunk released the stream


def test_one_final_chunk_is_the_offline_decode():
    """The reference's offline_inference is token2wav of one finalized block: streamed as one chunk, the same."""
    tokens, _ = case("three_blocks")
    (audio,) = codec().decode_stream([chunk("whole", 0, tokens, (0, len(tokens)), True)])
    assert_audio(audio, "three_blocks_offline_wave")


@pytest.mark.parametrize("bad", [16384, -1])
def test_out_of_range_tokens_name_the_field(bad):
    with pytest.raises(InvalidArgumentError) as err:
        codec().decode(torch.tensor([[[5], [bad]]]))
    assert err.value.field == "frames" and str(bad) in err.value.message
    with pytest.raises(InvalidArgumentError) as err:
        codec().decode_stream([chunk("bad", 0, [1, 2, bad, 4, 5, 6], (0, 6), False)])
    assert err.value.field == "frames"
    assert codec().cache_bytes("bad") == 0


def test_cache_miss_needs_the_history_from_token_zero():
    tokens, _ = case("short")
    fresh = GLM4VoiceCodec(codec().model)
    with pytest.raises(CacheMissError):
        fresh.decode_stream([chunk("miss", 1, tokens, (8, 20), True, start=4)])


def test_cache_miss_rebuilds_from_the_history():
    """A replica that never saw the stream decodes the history as one block, its audio dropped: with
    the reference's blocks (8, 12), the second chunk alone is the reference's second block."""
    tokens, blocks = case("short")
    assert blocks == [8, 12]
    fresh = GLM4VoiceCodec(codec().model)
    (audio,) = fresh.decode_stream([chunk("cold", 1, tokens, (8, 20), True)])
    assert fresh.num_rebuilds == 1
    assert_audio(audio, "short_block1_wave")

"""Codecs from tiny random checkpoints in their published layouts (SNAC's config.json +
pytorch_model.bin with old weight-norm keys, kyutai/mimi, descript/dac_44khz, X-Codec) through the
real loaders, against the same models in memory; and SNAC with the published `"noise": true`:
streamed audio equals offline audio."""

from __future__ import annotations

import pytest
import torch

from core.config import DetokConfig, ModelConfig
from detok_stage.codecs.dac_codec import DacCodec
from detok_stage.codecs.mimi_codec import MimiCodec
from detok_stage.codecs.snac_codec import FrameKeyedNoise, SnacCodec, frame_keys, keyed_normal
from detok_stage.codecs.xcodec_codec import XcodecCodec
from tests.detok_stage.interleaved import stream_interleaved
from tests.published_layouts import (
    dac_model,
    mimi_model,
    snac_model,
    write_dac,
    write_mimi,
    write_snac,
    write_xcodec,
    xcodec_model,
)

SPF = 2048


@pytest.fixture(scope="module")
def snac_dir(tmp_path_factory):
    return write_snac(tmp_path_factory.mktemp("snac"), snac_model(seed=1))


def snac_frames(num_frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 4096, (num_frames, 7), generator=torch.Generator().manual_seed(seed))


def quantized(wave: torch.Tensor) -> torch.Tensor:
    return (wave.clamp(-1, 1) * 32767).round() / 32767


def test_snac_published_layout_loads_old_weight_norm_keys_with_noise_blocks(snac_dir):
    state = torch.load(snac_dir / "pytorch_model.bin", weights_only=True)
    assert any(k.endswith(".weight_g") for k in state) and not any("parametrizations" in k for k in state)
    codec = SnacCodec.build(ModelConfig(name="orpheus", codec_dir=snac_dir))
    assert sum(isinstance(m, FrameKeyedNoise) for m in codec.model.modules()) == 4  # one per decoder block
    frames = snac_frames(6, 0)[None]
    reference = SnacCodec(snac_model(seed=1))  # the same weights, built in memory
    torch.testing.assert_close(codec.decode(frames), reference.decode(frames), atol=1e-5, rtol=0)


def test_snac_noise_is_on_standard_normal_and_fixed_per_frame(snac_dir):
    codec = SnacCodec.build(ModelConfig(name="orpheus", codec_dir=snac_dir))
    frames = snac_frames(8, 1)
    once, again = codec.decode(frames[None]), codec.decode(torch.stack([snac_frames(8, 9), frames]))[1:]
    torch.testing.assert_close(once, again, atol=1e-6, rtol=0)  # the same whatever else is in the batch
    silent = SnacCodec.build(ModelConfig(name="orpheus", codec_dir=snac_dir))
    for module in silent.model.modules():
        if isinstance(module, FrameKeyedNoise):
            module.linear.weight.data.zero_()
    assert (once - silent.decode(frames[None])).abs().max() > 1e-3  # the noise is audible in the output
    noise = keyed_normal(frame_keys(snac_frames(64, 2)[None]), SPF, salt=5)
    assert abs(float(noise.mean())) < 0.01 and abs(float(noise.std()) - 1.0) < 0.01


@pytest.mark.parametrize("schedule", ["wide", "reference"])
def test_snac_with_noise_streams_exactly_like_offline(snac_dir, schedule):
    codec = SnacCodec.build(ModelConfig(name="orpheus", codec_dir=snac_dir))
    frames_by_req = {f"r{i}": snac_frames(n, 10 + i) for i, n in enumerate([1, 6, 17])}
    got = stream_interleaved(codec, frames_by_req, DetokConfig(schedule=schedule, first_chunk_frames=2, chunk_frames=8))
    for rid, frames in frames_by_req.items():
        n = len(frames)
        if schedule == "wide":  # 3 frames of context each side covers SNAC's receptive field
            want = codec.decode(frames[None])[0]
        else:  # Orpheus' semantics: each frame decoded in its own 4-frame window
            pieces = []
            for j in range(n):
                lo, hi = max(0, j - 1), min(n, j + 3)
                pieces.append(codec.decode(frames[lo:hi][None])[0][(j - lo) * SPF : (j - lo + 1) * SPF])
            want = torch.cat(pieces)
        assert got[rid].shape[0] == n * SPF
        torch.testing.assert_close(got[rid], quantized(want), atol=2e-4, rtol=0)


def test_mimi_published_layout_decodes_like_the_model_in_memory(tmp_path):
    model = mimi_model(seed=2)
    codec = MimiCodec.build(ModelConfig(name="csm", codec_dir=write_mimi(tmp_path / "mimi", model)))
    frames = torch.randint(0, 64, (2, 6, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.decode(frames.transpose(1, 2)).audio_values[:, 0, : 6 * codec.samples_per_frame]
    torch.testing.assert_close(codec.decode(frames), want)


def test_dac_published_layout_decodes_like_the_model_in_memory(tmp_path):
    model = dac_model(seed=3)
    codec = DacCodec.build(ModelConfig(name="dia", codec_dir=write_dac(tmp_path / "dac", model)))
    assert (codec.codes_per_frame, codec.samples_per_frame, codec.sample_rate_hz) == (4, 512, 44100)
    frames = torch.randint(0, 64, (2, 5, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.decode(audio_codes=frames.transpose(1, 2)).audio_values
    torch.testing.assert_close(codec.decode(frames), want.reshape(2, -1))


def test_xcodec_published_layout_decodes_like_the_model_in_memory(tmp_path):
    model = xcodec_model(seed=4)
    codec = XcodecCodec.build(ModelConfig(name="parallel-heads", codec_dir=write_xcodec(tmp_path / "x", model)))
    frames = torch.randint(0, 1024, (1, 4, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.decode(audio_codes=frames.transpose(1, 2)).audio_values
    torch.testing.assert_close(codec.decode(frames), want.reshape(1, -1))

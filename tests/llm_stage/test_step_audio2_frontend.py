"""Step-Audio 2's front end on streamed audio (`step_audio2_frontend`, `stream_resample`): the resampled
samples and each 25 s piece's log-mel come out bit-equal whether the audio is pushed whole or in any
pieces, at every accepted rate; within float rounding of the published front end (`piece_log_mel` over
`resample`); and the adapter encodes a streamed turn's features exactly as the same clip sent whole."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from core.config import ModelConfig
from core.messages import AudioClip, AudioFeatures
from detok_stage.voice.clip import SUPPORTED_RATES_HZ
from detok_stage.voice.features import resample
from llm_stage.jobs import build_job
from llm_stage.models.clip_audio import clip_wave_16k
from llm_stage.models.step_audio2 import StepAudio2Adapter
from llm_stage.models.step_audio2_encoder import PIECE_SAMPLES, piece_log_mel, split_pieces
from llm_stage.models.step_audio2_frontend import MicFrontEnd, front_end_name
from llm_stage.models.stream_resample import StreamResampler


def noise_pcm16(num_samples: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return np.clip(rng.normal(0, 4000, num_samples), -32768, 32767).astype("<i2").tobytes()


def random_cuts(data: bytes, seed: int, max_bytes: int = 6000) -> list[bytes]:
    """`data` cut at random even offsets (whole samples), as a microphone client might send it."""
    cuts, rng, start = [], random.Random(seed), 0
    while start < len(data):
        size = 2 * rng.randint(1, max_bytes // 2)
        cuts.append(data[start : start + size])
        start += size
    return cuts


def features_of(pieces: list[bytes], rate: int) -> AudioFeatures:
    front = MicFrontEnd(rate)
    for piece in pieces:
        front.push_pcm16(piece)
    return front.finish()


@pytest.mark.parametrize("rate", SUPPORTED_RATES_HZ)
def test_resampler_pieces_equal_the_whole_and_the_published_filter(rate: int) -> None:
    pcm = noise_pcm16(rate + 777, rate)
    wave = torch.from_numpy(np.frombuffer(pcm, dtype="<i2") / 32768.0).float()
    whole = StreamResampler(rate, 16_000)
    at_once = torch.cat([whole.push(wave), whole.finish()])
    streamed = StreamResampler(rate, 16_000)
    cuts = torch.split(wave, [len(c) // 2 for c in random_cuts(pcm, rate, 3000)])
    in_pieces = torch.cat([streamed.push(c) for c in cuts] + [streamed.finish()])
    assert torch.equal(in_pieces, at_once)  # bit-equal, whatever the cuts
    published = resample(wave, rate, 16_000)
    assert in_pieces.shape == published.shape
    torch.testing.assert_close(in_pieces, published, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("rate", "seconds"), [(16_000, 0.01), (24_000, 1.3), (48_000, 2.0), (44_100, 0.7),
                                               (16_000, 25.0), (22_050, 26.1)])  # fmt: skip
def test_log_mel_pieces_equal_the_whole_clip_bit_for_bit(rate: int, seconds: float) -> None:
    pcm = noise_pcm16(round(rate * seconds), seed=int(seconds * 10))
    whole = features_of([pcm], rate)
    streamed = features_of(random_cuts(pcm, seed=rate), rate)
    assert whole.front_end == streamed.front_end == front_end_name(128)
    assert len(whole.mels) == len(streamed.mels) == len(split_pieces(clip_wave_16k(AudioClip(pcm, rate))))
    for got, want in zip(streamed.mels, whole.mels, strict=True):
        assert got.dtype == np.float32 and np.array_equal(got, want)
    published = [piece_log_mel(p) for p in split_pieces(clip_wave_16k(AudioClip(pcm, rate)))]
    for got, want in zip(whole.mels, published, strict=True):  # same frames; the resampler's rounding aside
        assert got.shape == tuple(want.shape)
        np.testing.assert_allclose(got, want.numpy(), atol=1e-6 if rate == 16_000 else 1e-4, rtol=0)


def test_a_piece_ending_on_the_25_s_boundary_makes_no_empty_piece() -> None:
    pcm = noise_pcm16(PIECE_SAMPLES, seed=3)
    streamed = features_of(random_cuts(pcm, seed=5, max_bytes=64_000), 16_000)
    assert len(streamed.mels) == 1 and np.array_equal(streamed.mels[0], features_of([pcm], 16_000).mels[0])


@pytest.fixture(scope="module")
def adapter() -> StepAudio2Adapter:
    return StepAudio2Adapter.build(ModelConfig(name="step-audio2-tiny", seed=1))


def turn_job(adapter: StepAudio2Adapter, clip: AudioClip, features: AudioFeatures | None):
    job = build_job(adapter, text="Answer.", voice=None, sampling={}, req_id="mic", ttfa_deadline_s=0.0,
                    default_ttfa_deadline_s=10.0, output_format="pcm16")  # fmt: skip
    return dataclasses.replace(job, audio=clip, audio_features=features)


def test_the_adapter_encodes_streamed_features_as_the_whole_clip(adapter) -> None:
    pcm = noise_pcm16(24_000 * 2, seed=9)
    streamed = features_of(random_cuts(pcm, seed=2), 24_000)
    rows = []
    for features in (None, streamed):  # the clip alone (the front end runs in the adapter), then the turn's
        adapter.forget_kept_clips()  # (encoded afresh: a clip known by content would come back as it was)
        prompt = adapter.job_prompt(turn_job(adapter, AudioClip(pcm, 24_000), features))
        adapter.prepare_step()
        rows.append((prompt, {h: adapter.clips.rows[h] for h in adapter.clips.handles_of("mic")}))
        adapter.forget("mic")
    (whole_prompt, whole_rows), (turn_prompt, turn_rows) = rows
    assert [t[::2] for t in whole_prompt] == [t[::2] for t in turn_prompt]  # ids and rows; handles differ
    assert all(torch.equal(a, b) for a, b in zip(whole_rows.values(), turn_rows.values(), strict=True))


def test_features_of_another_front_end_are_recomputed_from_the_clip(adapter) -> None:
    pcm = noise_pcm16(16_000, seed=4)
    foreign = AudioFeatures("another/front-end", (np.zeros((80, 10), dtype=np.float32),))
    mels = adapter.clip_mels(turn_job(adapter, AudioClip(pcm, 16_000), foreign))
    assert [m.shape[0] for m in mels] == [128]
    assert torch.equal(mels[0], torch.from_numpy(features_of([pcm], 16_000).mels[0]))

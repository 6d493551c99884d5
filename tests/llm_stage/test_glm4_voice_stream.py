"""GLM-4-Voice's speech tokenizer on streamed audio (`glm4_voice_stream`): the tokens come out bit-equal
whether a clip is pushed whole or in any pieces, equal to `SpeechTokenizer.tokens` (and so to the
reference's golden tokens), across a 30 s window boundary; a turn that ends far louder than it began
re-encodes the blocks the final floor changes, a steady one leaves only its last block for the end of the turn."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from core.errors import InvalidArgumentError
from llm_stage.models.glm4_voice_stream import MicTokenizer, WindowStream, whole_clip_tokens
from llm_stage.models.glm4_voice_tokenizer import SpeechTokenizer, tiny_shape
from tests.glm4_voice_tokenizer_layout import write_glm4_voice_tokenizer
from tests.llm_stage.test_glm4_voice_tokenizer import GOLDEN, golden_clips


def noise(seconds: float, seed: int, quiet_start: bool = False) -> torch.Tensor:
    """White noise; with `quiet_start` its first 60% 100 dB down, under the final floor (80 dB under the max)."""
    gen = torch.Generator().manual_seed(seed)
    wave = 0.1 * torch.randn(round(seconds * 16_000), generator=gen)
    if quiet_start:
        wave[: wave.numel() * 3 // 5] *= 1e-5
    return wave


def random_pieces(wave: torch.Tensor, seed: int, max_samples: int = 7000) -> list[torch.Tensor]:
    rng, out, start = random.Random(seed), [], 0
    while start < wave.numel():
        size = rng.randint(1, max_samples)
        out.append(wave[start : start + size])
        start += size
    return out


def streamed(tokenizer: SpeechTokenizer, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, MicTokenizer]:
    mic = MicTokenizer(tokenizer)
    for piece in pieces:
        mic.push_wave(piece)
    return mic.finish(), mic


@pytest.fixture(scope="module")
def tokenizer() -> SpeechTokenizer:
    return SpeechTokenizer.preset(0)


@pytest.mark.parametrize("quiet_start", [False, True])
def test_pieces_equal_the_whole_clip_and_the_batched_tokens(tokenizer: SpeechTokenizer, quiet_start: bool) -> None:
    wave = noise(2.3, seed=1, quiet_start=quiet_start)
    whole = whole_clip_tokens(tokenizer, wave)
    for seed in (0, 1):
        ids, mic = streamed(tokenizer, random_pieces(wave, seed))
        assert torch.equal(ids, whole)  # bit-equal, whatever the cuts
        blocks = -(-ids.numel() // (tokenizer.shape.quantize_causal_block_size // tokenizer.shape.pool))
        left = mic.window.num_encoded_at_finish if mic.window.num_samples else 0
        assert left > blocks // 2 if quiet_start else left == 1  # the loud end re-encodes; steady: the last block
    assert torch.equal(whole, tokenizer.tokens([wave])[0])


def test_streamed_golden_clips_match_the_reference(tmp_path) -> None:
    published = SpeechTokenizer.from_dir(write_glm4_voice_tokenizer(tmp_path / "tok", seed=0))
    golden = np.load(GOLDEN)
    for i, clip in enumerate(golden_clips()[:2]):
        ids, _ = streamed(published, random_pieces(clip, seed=i))
        np.testing.assert_array_equal(ids.numpy(), golden[f"tokens_{i}"])


def test_across_a_window_boundary(tokenizer: SpeechTokenizer) -> None:
    """31 s at blocks of 40 conv frames (0.8 s), so the test stays short."""
    shape = dataclasses.replace(tiny_shape(), quantize_causal_block_size=40)
    torch.manual_seed(2)
    wide = SpeechTokenizer(shape).eval()
    wave = noise(31.0, seed=3)
    ids, mic = streamed(wide, random_pieces(wave, seed=4, max_samples=40_000))
    assert torch.equal(ids, wide.tokens([wave])[0])
    assert ids.numel() == 375 + 13 and mic.window.num_samples == 16_000


def test_window_stream_keeps_stale_blocks_out(tokenizer: SpeechTokenizer) -> None:
    """A block encoded before the max rose is re-encoded only if its frames floor differently."""
    window = WindowStream(tokenizer)
    quiet, loud = noise(0.5, seed=5) * 1e-4, noise(0.5, seed=6)
    window.push(quiet)
    early = len(window.blocks)
    window.push(loud)
    assert early > 0
    assert torch.equal(window.finish(), tokenizer.tokens([torch.cat([quiet, loud])])[0])
    assert window.num_encoded_at_finish > len(window.blocks) - early  # the quiet blocks were encoded again


def test_pcm16_pieces_and_bad_input(tokenizer: SpeechTokenizer) -> None:
    pcm = np.clip(np.random.default_rng(7).normal(0, 3000, 9000), -32768, 32767).astype("<i2")
    mic = MicTokenizer(tokenizer)
    for start in range(0, pcm.size, 1234):
        mic.push_pcm16(pcm[start : start + 1234].tobytes())
    expected = whole_clip_tokens(tokenizer, torch.from_numpy(pcm.astype(np.float32) / 32768.0))
    assert torch.equal(mic.finish(), expected)
    with pytest.raises(InvalidArgumentError, match="empty") as err:
        MicTokenizer(tokenizer).finish()
    assert err.value.field == "input_audio"
    with pytest.raises(InvalidArgumentError, match="non-finite"):
        MicTokenizer(tokenizer).push_wave(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="block-causal"):
        MicTokenizer(SpeechTokenizer(dataclasses.replace(tiny_shape(), quantize_causal_block_size=None)))

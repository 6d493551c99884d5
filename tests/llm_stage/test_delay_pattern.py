"""Delay pattern: interleave / de-interleave round trips and the streaming de-interleaver."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_stage.delay_pattern import DelayPattern, StreamingDeinterleaver

BOS, PAD = 1_000_001, 1_000_002


@st.composite
def pattern_and_frames(draw):
    num_codebooks = draw(st.integers(1, 9))
    delays = tuple(draw(st.lists(st.integers(0, 16), min_size=num_codebooks, max_size=num_codebooks)))
    num_frames = draw(st.integers(0, 40))
    codes = st.lists(st.integers(0, 4095), min_size=num_codebooks, max_size=num_codebooks)
    frames = draw(st.lists(codes, min_size=num_frames, max_size=num_frames))
    return DelayPattern(delays, BOS, PAD), frames


@settings(max_examples=100, deadline=None)
@given(pattern_and_frames())
def test_interleave_then_deinterleave_is_identity(case):
    pattern, frames = case
    steps = pattern.interleave(frames)
    assert len(steps) == len(frames) + pattern.max_delay
    assert pattern.deinterleave(steps) == frames


@settings(max_examples=100, deadline=None)
@given(pattern_and_frames())
def test_bos_before_and_pad_after_each_codebook(case):
    pattern, frames = case
    steps = pattern.interleave(frames)
    for k, delay in enumerate(pattern.delays):
        column = [step[k] for step in steps]
        assert column[:delay] == [BOS] * delay
        assert column[delay : delay + len(frames)] == [f[k] for f in frames]
        assert column[delay + len(frames) :] == [PAD] * (pattern.max_delay - delay)


@settings(max_examples=100, deadline=None)
@given(pattern_and_frames())
def test_streaming_releases_each_frame_at_its_last_codebook(case):
    pattern, frames = case
    stream = StreamingDeinterleaver(pattern)
    released: list[list[int]] = []
    for step, ids in enumerate(pattern.interleave(frames)):
        new = stream.push(ids)
        # frame t is complete exactly at step t + max_delay, and released then, not later
        expected_count = max(0, min(len(frames), step - pattern.max_delay + 1))
        released.extend(new)
        assert len(released) == expected_count
    assert released == frames


def test_bad_patterns_and_widths_rejected():
    with pytest.raises(ValueError):
        DelayPattern((), BOS, PAD)
    with pytest.raises(ValueError):
        DelayPattern((0, -1), BOS, PAD)
    with pytest.raises(ValueError):
        StreamingDeinterleaver(DelayPattern((0, 1), BOS, PAD)).push([1, 2, 3])


def test_dia_pattern_forced_bos():
    pattern = DelayPattern((0, 8, 9), BOS, PAD)
    assert [pattern.forced_id(s, 1) for s in (0, 7, 8)] == [BOS, BOS, None]
    assert pattern.forced_id(0, 0) is None

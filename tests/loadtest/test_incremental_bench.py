"""The incremental bench's Poisson sweep arrivals: seeded, within the window, at about the rate."""

from __future__ import annotations

from loadtest.incremental_bench import poisson_offsets_s


def test_poisson_offsets_are_seeded_increasing_and_near_the_rate():
    offsets = poisson_offsets_s(2.0, 500.0, seed=3)
    assert offsets == poisson_offsets_s(2.0, 500.0, seed=3) and offsets == sorted(offsets)
    assert 0.0 < offsets[0] and offsets[-1] < 500.0
    assert 900 < len(offsets) < 1100  # 2 / s over 500 s

"""`cluster.incremental_client`: words as pieces, and each piece's time to the first audio of the
segment that speaks it (the figure `voxray say --incremental` prints)."""

from __future__ import annotations

import pytest

from cluster.incremental_client import IncrementalResult, words


def test_words_keep_their_following_space():
    assert words("Hi there,  you.\nOk") == ["Hi ", "there,  ", "you.\n", "Ok"]


def test_each_piece_waits_for_the_first_audio_of_its_segment():
    result = IncrementalResult(
        pieces=["Hello ", "there. ", "How ", "are ", "you?"],
        piece_sent_s=[0.0, 0.1, 0.2, 0.3, 0.4],
        segment_texts=["Hello there.", "How are you?"],
        segment_first_audio_s=[0.5, 1.0],
    )
    assert result.first_audio_s == 0.5
    assert result.piece_latencies_s() == pytest.approx([0.5, 0.4, 0.8, 0.7, 0.6])


def test_pieces_of_a_segment_without_audio_have_no_latency():
    result = IncrementalResult(
        pieces=["One. ", "Two."], piece_sent_s=[0.0, 0.1], segment_texts=["One."], segment_first_audio_s=[0.3]
    )
    assert result.piece_latencies_s() == [pytest.approx(0.3), None]

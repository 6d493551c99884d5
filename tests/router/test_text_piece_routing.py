"""Text pieces of a streaming-text request are pinned to the LLM replica running it (the request
router's `_pinned_replica`), a microphone turn's pieces to the replica tokenizing it (its first piece
is ranked as usual, and like every piece not counted as a stream); every other call is ranked as usual."""

from __future__ import annotations

from types import SimpleNamespace

from core.messages import Job, MicPiece, SamplingParams, TextPiece
from router.dispatch import _piece, _pinned_replica


def replica(unique_id: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id))


def pending(*args) -> SimpleNamespace:
    return SimpleNamespace(args=list(args), kwargs={})


def test_a_text_piece_goes_to_the_replica_its_stream_head_named():
    replicas = [replica("aaa"), replica("bbb"), replica("ccc")]
    piece = TextPiece("r1", "LLMStage#bbb", "more text")
    assert _pinned_replica(pending(piece), replicas) is replicas[1]


def test_other_calls_and_pieces_for_a_gone_replica_are_routed_as_usual():
    replicas = [replica("aaa")]
    job = Job("r1", "hi", None, SamplingParams(), 1.0)
    assert _pinned_replica(pending(job), replicas) is None
    assert _pinned_replica(pending(), replicas) is None and _pinned_replica(None, replicas) is None
    assert _pinned_replica(pending(TextPiece("r1", "LLMStage#zzz", "x")), replicas) is None


def test_a_microphone_turns_pieces_go_to_the_replica_its_first_reply_named():
    replicas = [replica("aaa"), replica("bbb")]
    first, later = MicPiece("t1", "", 16_000, 0, b"\0\0"), MicPiece("t1", "LLMStage#aaa", 16_000, 1, b"\0\0")
    assert _pinned_replica(pending(first), replicas) is None and _piece(pending(first)) is first  # ranked, uncounted
    assert _pinned_replica(pending(later), replicas) is replicas[0]
    assert _piece(pending(Job("r1", "hi", None, SamplingParams(), 1.0))) is None  # a stream: counted

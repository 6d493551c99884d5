"""What the router keeps of a stream for resuming it elsewhere (`router.resume.StreamProgress`):
the checkpoints' tokens added up, where the client stands, and the detok replica holding a
stateful detokenizer's decoder state, so the replica that resumes it decodes on the same one."""

from __future__ import annotations

from core.messages import AudioReady, AudioRef, Checkpoint, ResumeState, TokenChunk
from router.resume import StreamProgress


def ready(seq: int, detok: str, checkpoint: Checkpoint | None = None) -> AudioReady:
    chunk = TokenChunk("r", seq, [[seq]] * 4, 4 * seq, 4 * seq, 4 * seq + 4, False)
    return AudioReady(AudioRef("r", seq, False, 0.08, 4, None, chunk, 0, detok), checkpoint)


def test_resume_state_carries_tokens_position_and_the_detok_replica_of_the_last_chunk():
    progress = StreamProgress()
    progress.record(ready(0, "DetokStage#a", Checkpoint(0, (1, 2, 3))))
    progress.record(ready(1, "DetokStage#a"))
    progress.record(ready(2, "", Checkpoint(3, (4, 5))))  # an unnamed decode keeps the last one known
    state = progress.resume_state()
    assert (state.tokens, state.next_seq, state.frames_shipped) == ((1, 2, 3, 4, 5), 3, 12)
    assert state.detok_replica == "DetokStage#a" and state.kv is None
    progress.record(ready(3, "DetokStage#b"))  # its pinned replica was lost: the state lives on b now
    assert progress.resume_state().detok_replica == "DetokStage#b"


def test_a_handoff_names_its_detok_replica_and_later_chunks_update_it():
    progress = StreamProgress()
    progress.record(ready(0, "DetokStage#a", Checkpoint(0, (1,))))
    progress.adopt(ResumeState((1, 2), 1, 4, detok_replica="DetokStage#c"))
    assert progress.resume_state().detok_replica == "DetokStage#c" and progress.resume_state().tokens == (1, 2)
    progress.adopt(ResumeState((1, 2), 1, 4))  # a stateless codec's handoff names none: kept
    assert progress.resume_state().detok_replica == "DetokStage#c"

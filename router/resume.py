"""What the router keeps of each stream so another LLM replica can continue it: the sampler
checkpoints that arrive with the audio and the text (`Checkpoint` deltas, added up) and the last chunk the
client received, and the detok replica that decoded it (a stateful detokenizer's decoder state
lives there: the replica that resumes the stream pins it to the same one). `RouterCore` turns it
into the `ResumeState` of a resumed Job when the replica serving the stream dies.
"""

from __future__ import annotations

import dataclasses

from core.messages import AudioReady, Checkpoint, ResumeState, SampledToken, TextDelta


class StreamProgress:
    def __init__(self) -> None:
        self.tokens: list[SampledToken] = []  # sampled tokens the checkpoints cover, in order
        self.next_seq = 0  # the first chunk the client has not received
        self.frames_shipped = 0  # frames covered by the chunks it has
        self.is_resumable = True  # False once a checkpoint was missed (then a resume could skip tokens)
        self.detok_replica = ""  # the detok replica that decoded its last chunk (a stateful codec's state is there)

    def record(self, event: AudioReady) -> None:
        """One chunk reached the client; its checkpoint (if any) extends the known tokens."""
        self._extend(event.checkpoint)
        self.next_seq = event.ref.seq + 1
        self.frames_shipped = event.ref.chunk.keep_end
        self.detok_replica = event.ref.detok_replica or self.detok_replica

    def record_text(self, delta: TextDelta) -> None:
        """A piece of the answer's text reached the client: its checkpoint extends the known tokens, so a
        resumed stream goes on after that text (a spoken answer's chunks may come later: the replica that
        resumes it cuts them from those tokens)."""
        self._extend(delta.checkpoint)

    def _extend(self, checkpoint: Checkpoint | None) -> None:
        if checkpoint is None:
            return
        if checkpoint.first_index > len(self.tokens):
            self.is_resumable = False
        del self.tokens[checkpoint.first_index :]
        self.tokens.extend(checkpoint.new_tokens)

    def adopt(self, handoff: ResumeState) -> None:
        """A replica handed the stream off with its full state: later checkpoints extend that."""
        self.tokens = list(handoff.tokens)
        self.next_seq, self.frames_shipped = handoff.next_seq, handoff.frames_shipped
        self.detok_replica = handoff.detok_replica or self.detok_replica

    def resume_state(self) -> ResumeState:
        state = ResumeState(tuple(self.tokens), self.next_seq, self.frames_shipped)
        return dataclasses.replace(state, detok_replica=self.detok_replica)

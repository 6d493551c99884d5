"""Which detok replica decodes each stream, for stateful detokenizers (M:N placement).

A stateful codec (Mimi, Qwen3-TTS, S3Gen) keeps each stream's decoder state on the detok replica
that decoded its last chunk; a chunk reaching another replica rebuilds that state from the
chunk's left context, exact only at the stream's start (mid-stream the audio drifts). So an LLM
replica sends all of a stream's chunks to one detok replica: chosen at the stream's first chunk
(the fewest streams this LLM replica placed there, then the fewest its last report counts), kept
while that replica lives; when it is gone, the replica that decoded the stream's chunk instead.
Pure Python: the LLM replica feeds it the live detok replicas from its handle's router.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from core.messages import TokenChunk


@dataclass
class DetokPins:
    by_stream: dict[str, str] = field(default_factory=dict)  # req_id -> detok replica's unique id
    placed: Counter = field(default_factory=Counter)  # streams placed on each replica so far (for stats)

    def target(self, req_id: str, live: dict[str, int]) -> str:
        """The detok replica `req_id`'s chunks go to ("" = let the handle's router choose: no live
        replica known yet). `live`: unique id -> streams its last report counts."""
        pinned = self.by_stream.get(req_id)
        if pinned is not None and (pinned in live or not live):
            return pinned
        if not live:
            return ""
        pinned_now = Counter(self.by_stream.values())
        choice = min(live, key=lambda replica: (pinned_now[replica], live[replica], replica))
        self.by_stream[req_id] = choice
        self.placed[choice] += 1
        return choice

    def split(self, chunks: list[TokenChunk], live: dict[str, int]) -> dict[str, list[TokenChunk]]:
        """`chunks` grouped by the replica each goes to, in their order (one decode call per group)."""
        groups: dict[str, list[TokenChunk]] = {}
        for chunk in chunks:
            groups.setdefault(self.target(chunk.req_id, live), []).append(chunk)
        return groups

    def decoded_on(self, req_id: str, replica: str) -> None:
        """`req_id`'s chunk was decoded on `replica` (its tag `DetokStage#id` or its unique id; its
        pinned one was gone, or none was chosen): its state lives there now, so its later chunks
        follow it."""
        if replica:
            self.by_stream[req_id] = replica.rsplit("#", 1)[-1]

    def forget(self, req_id: str) -> None:
        self.by_stream.pop(req_id, None)

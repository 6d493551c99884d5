"""Chunk schedules and the per-request chunker that cuts a frame stream into TokenChunks.

A chunk keeps frames [s, e) and carries `left_context_frames` before and `right_context_frames`
after (clipped at the stream's edges), so a cold detokenizer decodes it on its own. Used on the
LLM side (in-process pipeline and LLMStage) to decide when a chunk is ready.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import DetokConfig
from core.messages import TokenChunk
from core.policy import SchedulingPolicy


@dataclass(frozen=True)
class ChunkSchedule:
    first_chunk_frames: int
    chunk_frames: int
    left_context_frames: int
    right_context_frames: int
    adaptive: bool = False

    @classmethod
    def from_config(cls, config: DetokConfig) -> ChunkSchedule:
        """`reference`, or the wide fields (`wide`, and `auto` for a family without a schedule of its own)."""
        if config.schedule == "reference":  # Orpheus' own: 4-frame window, keep its 2nd frame
            return cls(first_chunk_frames=1, chunk_frames=1, left_context_frames=1, right_context_frames=2)
        return cls(
            config.first_chunk_frames, config.chunk_frames, config.left_context_frames, config.right_context_frames,
            config.adaptive,
        )  # fmt: skip

    @classmethod
    def for_policy(
        cls, config: DetokConfig, policy: SchedulingPolicy, family_schedule: ChunkSchedule | None = None
    ) -> ChunkSchedule:
        """`auto` with a family that declares its own schedule: that one, under every policy (its chunks
        are already long). Otherwise throughput mode has no deadlines: every chunk is
        `throughput_chunk_frames` long, so fewer context frames are decoded twice; the other
        policies use `from_config`."""
        if config.schedule == "auto" and family_schedule is not None:
            return family_schedule
        if not policy.uses_long_chunks or config.schedule == "reference":
            return cls.from_config(config)
        size = config.throughput_chunk_frames
        return cls(size, size, config.left_context_frames, config.right_context_frames)

    def chunk_size(self, seq: int) -> int:
        """Frames kept by chunk `seq`: small first, then steady; adaptive sizes double up to `chunk_frames`."""
        if seq == 0:
            return self.first_chunk_frames
        if not self.adaptive:
            return self.chunk_frames
        return max(1, min(self.chunk_frames, self.first_chunk_frames << seq))

    def longest_window(self) -> tuple[int, int, int]:
        """(left context, kept frames, right context) of the longest window this schedule cuts (what a
        detokenizer warms up on); a whole-stream left context (a stateful detokenizer's history) is
        capped at two chunks: such a codec keeps each stream's state and decodes only new frames."""
        keep = max(self.first_chunk_frames, self.chunk_frames)
        return min(self.left_context_frames, 2 * keep), keep, self.right_context_frames

    @property
    def decode_factor(self) -> float:
        """Steady-state frames decoded per frame emitted."""
        return (self.left_context_frames + self.chunk_frames + self.right_context_frames) / self.chunk_frames


WHOLE_STREAM_FRAMES = 131072  # >= any stream: the largest cache.max_seq_len


def whole_stream_schedule(first_chunk_frames: int, chunk_frames: int, right_context_frames: int) -> ChunkSchedule:
    """Steady `chunk_frames` chunks (after the first) that carry the whole stream so far as left
    context: what a stateful detokenizer needs to rebuild a request's state on a replica that never saw it."""
    return ChunkSchedule(first_chunk_frames, chunk_frames, WHOLE_STREAM_FRAMES, right_context_frames)


class Chunker:
    """Accumulates one request's frames and emits ready TokenChunks in seq order."""

    def __init__(self, req_id: str, schedule: ChunkSchedule) -> None:
        self.req_id = req_id
        self.schedule = schedule
        self._frames: list[list[int]] = []
        self._base = 0  # absolute index of self._frames[0]; older frames are dropped
        self._emitted = 0  # frames already covered by chunks
        self._seq = 0
        self._num_to_skip = 0  # frames still to arrive that lie before `_base` (a resumed stream)

    @classmethod
    def resumed(cls, req_id: str, schedule: ChunkSchedule, next_seq: int, frames_shipped: int) -> Chunker:
        """A chunker for a stream another replica started: chunks go on at `next_seq` from frame
        `frames_shipped`; its frames are pushed again from frame 0 and only the left context of
        the next chunk is kept."""
        chunker = cls(req_id, schedule)
        chunker._emitted, chunker._seq = frames_shipped, next_seq
        chunker._base = chunker._num_to_skip = max(0, frames_shipped - schedule.left_context_frames)
        return chunker

    @property
    def next_seq(self) -> int:
        return self._seq

    @property
    def num_emitted(self) -> int:
        """Frames covered by the chunks cut so far."""
        return self._emitted

    @property
    def num_frames(self) -> int:
        return self._base + len(self._frames) - self._num_to_skip

    def _next_size(self, frame_budget: int | None) -> int:
        size = self.schedule.chunk_size(self._seq)
        if frame_budget is None or not self.schedule.adaptive or self._seq == 0:
            return size
        if frame_budget <= 0:
            # The client's buffer is spent: it plays nothing until this chunk lands, so restart as a
            # new stream does. Shrinking further would only multiply the context frames decoded per
            # frame kept, and under load that extra detokenizer work starves every stream.
            return min(size, self.schedule.first_chunk_frames)
        return min(size, frame_budget)  # the client cannot wait for a bigger chunk

    def frames_to_next_chunk(self, frame_budget: int | None = None) -> int:
        end = self._emitted + self._next_size(frame_budget) + self.schedule.right_context_frames
        return max(0, end - self.num_frames)

    def frames_to_smallest_next_chunk(self) -> int:
        """Frames still missing before the smallest chunk this stream may cut next (one frame for
        adaptive chunks after the first; the scheduled size otherwise): what a stream left out
        of the batch needs before its buffer runs dry, since adaptive chunks shrink to fit it."""
        return self.frames_to_next_chunk(frame_budget=1)

    def push(self, frames: list[list[int]], frame_budget: int | None = None) -> list[TokenChunk]:
        """Add frames; cut every chunk whose kept frames and right context are known.

        `frame_budget` caps an adaptive chunk at the frames the client's buffer can wait for.
        """
        self.add_frames(frames)
        chunks = []
        while True:
            end = self._emitted + self._next_size(frame_budget)
            if self.num_frames < end + self.schedule.right_context_frames:
                return chunks
            chunks.append(self._cut(end, is_final=False))

    def add_frames(self, frames: list[list[int]]) -> None:
        """Add frames without cutting (a resumed stream's replayed frames; `push` cuts later)."""
        skipped = min(len(frames), self._num_to_skip)
        self._num_to_skip -= skipped
        self._frames.extend(frames[skipped:])

    def finish(self) -> list[TokenChunk]:
        """Flush the remaining frames (right context clipped at the end); the last chunk is final."""
        chunks = []
        while self.num_frames - self._emitted > self.schedule.chunk_size(self._seq):
            chunks.append(self._cut(self._emitted + self.schedule.chunk_size(self._seq), is_final=False))
        # max: a resumed unseeded stream may stop before the frames the lost replica shipped
        chunks.append(self._cut(max(self.num_frames, self._emitted), is_final=True))
        return chunks

    def _cut(self, end: int, is_final: bool) -> TokenChunk:
        start = self._emitted
        window_start = max(0, start - self.schedule.left_context_frames)
        window_end = min(self.num_frames, end + self.schedule.right_context_frames)
        frames = self._frames[window_start - self._base : window_end - self._base]
        chunk = TokenChunk(self.req_id, self._seq, frames, window_start, start, end, is_final)
        self._emitted, self._seq = end, self._seq + 1
        self._trim()
        return chunk

    def _trim(self) -> None:
        keep_from = max(self._base, self._emitted - self.schedule.left_context_frames)
        del self._frames[: keep_from - self._base]
        self._base = keep_from

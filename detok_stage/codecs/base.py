"""The codec-adapter contract the detokenizer engine drives.

An adapter knows its frame layout (codes per frame, samples per frame, sample rate), validates
codes, and decodes a batch of equal-length frame windows to float audio in one forward.
A stateful codec (`is_stateful`, e.g. Mimi) instead decodes chunks with per-request caches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterator, Sequence

import torch

from core.errors import InvalidArgumentError
from core.messages import TokenChunk, VoiceConditioning

SNAPSHOTS_KEPT = 4  # a stateful codec's states from before a stream's last chunks: chunks decoded, never received


def keep_snapshot(before: dict, start_frame: int, snapshot) -> None:
    """Keep `snapshot`, the state a stream's chunk starting at `start_frame` was decoded from, in
    `before` (start frame -> state), with the SNAPSHOTS_KEPT most recent: a stream resumed on
    another LLM replica sends again the chunks the router never got, and they decode from these."""
    before[start_frame] = snapshot
    while len(before) > SNAPSHOTS_KEPT:
        del before[min(before)]


def checked_codes(tokens: list[int], codebook_size: int, field_name: str) -> list[int]:
    """`tokens` if every one lies in [0, codebook_size), else InvalidArgumentError naming `field_name` and
    the first one outside (a one-code-per-frame codec's input check)."""
    for index, token in enumerate(tokens):
        if token < 0 or token >= codebook_size:
            message = f"token {index} is {token}, outside the codebook [0, {codebook_size})"
            raise InvalidArgumentError(field_name, message)
    return tokens


def padded_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """[len(rows), longest] float audio, each row zero-padded at its end (a batch of offline decodes)."""
    out = torch.zeros(len(rows), max((row.numel() for row in rows), default=0))
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def chunk_rounds(chunks: Sequence[TokenChunk]) -> Iterator[dict[str, int]]:
    """A stateful codec's batch in rounds: each round {req_id: index in `chunks`} of every request's earliest
    chunk not yet taken (a request's chunks decode in their order, one a round), until all are taken."""
    queues: dict[str, list[int]] = defaultdict(list)
    for index, chunk in enumerate(chunks):
        queues[chunk.req_id].append(index)
    while queues:
        yield {rid: queue.pop(0) for rid, queue in queues.items()}
        queues = {rid: queue for rid, queue in queues.items() if queue}


class CodecAdapter(ABC):
    codes_per_frame: int
    samples_per_frame: int
    sample_rate_hz: int
    codebook_size: int
    is_stateful: bool = False
    # What a chunk schedule must give this codec (the registry refuses a schedule that does not):
    min_right_context_frames: int = 0  # look-ahead frames every chunk must carry
    needs_stream_history: bool = False  # every chunk carries the stream from frame 0 as left context
    bounds_flow_history: bool = False  # a flow-matching detokenizer whose estimator may read a bounded history

    @abstractmethod
    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [B, n, codes_per_frame] (long) -> audio [B, n * samples_per_frame] float in [-1, 1]."""

    def decode_on_device(self, frames: torch.Tensor) -> torch.Tensor | None:
        """`decode` without host transfers: frames and audio stay on the codec's device (what a CUDA
        graph captures). None = this codec does not offer it, so it always decodes eagerly."""
        return None

    @property
    def captures_windows(self) -> bool:
        """Whether its windows can replay as CUDA graphs: stateless, and offering `decode_on_device`."""
        return not self.is_stateful and type(self).decode_on_device is not CodecAdapter.decode_on_device

    def enable_graphs(self, batch_sizes: Sequence[int]) -> bool:
        """A stateful codec that replays its own streamed forward as CUDA graphs turns them on for chunk
        batches padded to `batch_sizes` (True); the others decode their streams eagerly (False)."""
        return False

    def bound_flow_history(self, sink_frames: int, window_frames: int) -> None:
        """Flow detokenizers (`bounds_flow_history`): the estimator reads the first `sink_frames` mel frames
        and the `window_frames` before each attention chunk, not every earlier one (0 = every one)."""
        raise NotImplementedError(f"{type(self).__name__} has no flow estimator history to bound")

    def set_default_voice(self, voice: VoiceConditioning) -> None:
        """Codecs that take zero-shot voices: `voice` becomes what a chunk naming none decodes in
        (`voices.default_clip`)."""
        raise NotImplementedError(f"{type(self).__name__} takes no zero-shot voices")

    def decode_stream(self, chunks: list[TokenChunk]) -> list[torch.Tensor]:
        """Stateful codecs: audio [keep frames * samples_per_frame] per chunk, chunks of a request in seq order."""
        raise NotImplementedError(f"{type(self).__name__} decodes stateless windows")

    def release(self, req_id: str) -> None:
        """Drop a request's per-request decoder cache (stateful codecs; stateless ones hold none)."""
        return None

    def check_frames(self, frames: list[list[int]]) -> str | None:
        """Return a description of the first invalid frame, or None when all decode."""
        for index, frame in enumerate(frames):
            if len(frame) != self.codes_per_frame:
                return f"frame {index} has {len(frame)} codes, expected {self.codes_per_frame}"
            if any(code < 0 or code >= self.codebook_size for code in frame):
                return f"frame {index} has a code outside [0, {self.codebook_size})"
        return None

    @property
    def frame_duration_s(self) -> float:
        return self.samples_per_frame / self.sample_rate_hz

"""Encoded clips a speech-in adapter keeps by content, for a family whose audio enters the prompt as encoder
rows at placeholder ids (Step-Audio 2): a clip sent again (a conversation's earlier turns come back every
turn) gets the handles it had, so it is neither front-ended nor encoded again, and its placeholder tokens
(id, handle, row) are the same, which lets the prompt KV kept after the last turn serve the next one
(`llm_stage.kept_prompts`). Each request holds its clips' handles until it ends; a clip no request holds
stays, most recently released last, up to `max_idle_pieces` pieces. Used by `step_audio2.StepAudio2Adapter`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

MAX_IDLE_PIECES = 64  # encoded 25 s pieces kept with no request holding them (~27 minutes of audio)


class ClipRows:
    """Handles of encoded clip pieces: their rows once encoded, the log-mels still to encode."""

    def __init__(self, max_idle_pieces: int = MAX_IDLE_PIECES) -> None:
        self.max_idle_pieces = max_idle_pieces
        self.rows: dict[int, torch.Tensor] = {}  # handle -> embeddings [n, H]
        self.pending: list[tuple[int, torch.Tensor]] = []  # (handle, log-mel) to encode next step
        self._pieces_of: dict[bytes, list[tuple[int, int]]] = {}  # clip key -> (handle, placeholder rows) per piece
        self._clip_of: dict[int, bytes] = {}
        self._holders: dict[int, int] = {}  # handle -> requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # handles no request holds, oldest first
        self._held_by: dict[str, list[int]] = {}  # req_id -> the handles it holds
        self._next_handle = 0

    def pieces(
        self, req_id: str, key: bytes, mels: Callable[[], list[torch.Tensor]], rows_of: Callable[[torch.Tensor], int]
    ) -> tuple[list[tuple[int, int]], bool]:
        """The clip's (handle, placeholder rows) per piece, now held by `req_id`, and whether it was new:
        a known clip's as they are, else `mels()` of its pieces queued to encode."""
        pieces = self._pieces_of.get(key)
        is_new = pieces is None
        if pieces is None:
            pieces = self._pieces_of[key] = [self._queue(key, mel, rows_of(mel)) for mel in mels()]
        for handle, _ in pieces:
            self._holders[handle] = self._holders.get(handle, 0) + 1
            self._idle.pop(handle, None)
            self._held_by.setdefault(req_id, []).append(handle)
        return pieces, is_new

    def encode(self, encoder: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
        """Every queued piece through `encoder` in one call."""
        if not self.pending:
            return
        handles, mels = zip(*self.pending, strict=True)
        self.pending = []
        self.rows.update(zip(handles, encoder(list(mels)), strict=True))

    def handles_of(self, req_id: str) -> list[int]:
        return list(self._held_by.get(req_id, []))

    def release(self, req_id: str) -> None:
        """`req_id` ended: its handles no longer held by it. An encoded clip no request holds is kept (the
        oldest past the cap dropped); one not encoded yet is dropped (nothing was spent on it)."""
        idle = []
        for handle in self._held_by.pop(req_id, []):
            self._holders[handle] -= 1
            if self._holders[handle] == 0:
                idle.append(handle)
        queued = {handle for handle, _ in self.pending}
        for key in {self._clip_of[h] for h in idle if h in queued}:
            self._drop_clip(key)
        self._idle.update((handle, None) for handle in idle if handle in self._clip_of)
        while len(self._idle) > self.max_idle_pieces:
            self._drop_clip(self._clip_of[next(iter(self._idle))])

    def _queue(self, key: bytes, mel: torch.Tensor, num_rows: int) -> tuple[int, int]:
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self.pending.append((handle, mel))
        self._clip_of[handle] = key
        self._holders[handle] = 0
        return handle, num_rows

    def _drop_clip(self, key: bytes) -> None:
        handles = {handle for handle, _ in self._pieces_of.pop(key)}
        self.pending = [(h, mel) for h, mel in self.pending if h not in handles]
        for handle in handles:
            self.rows.pop(handle, None)
            self._clip_of.pop(handle, None)
            self._holders.pop(handle, None)
            self._idle.pop(handle, None)

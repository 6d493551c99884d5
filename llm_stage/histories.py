"""The repetition penalty's history per request as a growing int64 array, extended by the tokens
added since the previous step: a step's sampling rows carry each request's window as an array
view, so no step converts every prompt and output id from Python ints again (at 128 rows of 600
ids that conversion alone took 1.2-8 ms of host time per step, past a whole GPU decode step).

Used by `LLMEngine` for adapters on the default history (prompt + output ids, one codebook);
other families keep `LMAdapter.penalty_history`.
"""

from __future__ import annotations

import numpy as np

from llm_stage.models.base import LMAdapter
from llm_stage.request import Request


def uses_default_history(adapter: LMAdapter) -> bool:
    """Whether the adapter's penalty looks at its requests' plain prompt + output ids."""
    kind = type(adapter)
    return (
        adapter.num_codebooks == 1
        and kind.penalty_history is LMAdapter.penalty_history
        and kind.history_ids is LMAdapter.history_ids
    )


class PenaltyHistories:
    def __init__(self) -> None:
        self._ids: dict[str, np.ndarray] = {}  # prompt + output ids so far (a prefix of the buffer)
        self._filled: dict[str, int] = {}

    def window(self, req: Request, window: int) -> np.ndarray:
        """The last `window` ids of `req`'s prompt + output (all when 0), as a read-only view."""
        total = len(req.prompt_ids) + len(req.output_ids)
        filled = self._filled.get(req.req_id, 0)
        ids = self._ids.get(req.req_id)
        if ids is None or filled > total:  # new, or its tokens were replaced (a resume): start over
            ids, filled = np.empty(max(64, 2 * total), dtype=np.int64), 0
        if total > len(ids):
            ids = np.concatenate([ids[:filled], np.empty(2 * total - filled, dtype=np.int64)])
        if filled < total:
            ids[filled:total] = self._tokens(req, filled, total)
        self._ids[req.req_id], self._filled[req.req_id] = ids, total
        view = ids[max(0, total - window) if window else 0 : total]
        view.flags.writeable = False
        return view

    @staticmethod
    def _tokens(req: Request, start: int, end: int) -> list[int]:
        prompt = len(req.prompt_ids)
        head = req.prompt_ids[start:end] if start < prompt else []
        return head + req.output_ids[max(0, start - prompt) : end - prompt]  # type: ignore[return-value]

    def forget(self, req_id: str) -> None:
        self._ids.pop(req_id, None)
        self._filled.pop(req_id, None)

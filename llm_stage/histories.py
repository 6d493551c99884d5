"""The repetition penalty's history per request as a growing int64 array, extended by the tokens
added since the previous step: a step's sampling rows carry each request's window as an array
view, so no step converts every prompt and output id from Python ints again (at 128 rows of 600
ids that conversion alone took 1.2-8 ms of host time per step, past a whole GPU decode step).

Used by `LLMEngine` for one-codebook adapters on the default `penalty_history` whose `history_ids`
is the default (prompt + output ids) or maps each token on its own (`LMAdapter.history_ids_per_token`:
CosyVoice 2 and Chatterbox keep only the speech ids); other families keep `LMAdapter.penalty_history`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from llm_stage.models.base import LMAdapter
from llm_stage.request import Request, Token


def _default_penalty(adapter: LMAdapter) -> bool:
    """One codebook, penalised over `history_ids` by the default `penalty_history`."""
    return adapter.num_codebooks == 1 and type(adapter).penalty_history is LMAdapter.penalty_history


def uses_default_history(adapter: LMAdapter) -> bool:
    """Whether the adapter's penalty looks at its requests' plain prompt + output ids."""
    return _default_penalty(adapter) and type(adapter).history_ids is LMAdapter.history_ids


def uses_incremental_history(adapter: LMAdapter) -> bool:
    """Whether `PenaltyHistories` can keep the adapter's histories: the default penalty history, one
    codebook, and `history_ids` the default or a map of each token on its own."""
    return uses_default_history(adapter) or (_default_penalty(adapter) and adapter.history_ids_per_token)


def incremental_histories(adapter: LMAdapter) -> PenaltyHistories | None:
    """The engine's histories for `adapter` (None: it keeps `LMAdapter.penalty_history`)."""
    if uses_default_history(adapter):
        return PenaltyHistories()
    if uses_incremental_history(adapter):
        return PenaltyHistories(adapter.history_ids)
    return None


class PenaltyHistories:
    """`history_ids`: the adapter's per-token map (None: every token is its own id). With one, the
    window of the last N positions starts at the ids the positions before it kept (`_kept`)."""

    def __init__(self, history_ids: Callable[[list[Token], int], list[int]] | None = None) -> None:
        self._history_ids = history_ids
        self._ids: dict[str, np.ndarray] = {}  # the history ids so far (a prefix of the buffer)
        self._num_ids: dict[str, int] = {}
        self._kept: dict[str, list[int]] = {}  # mapped only: [i] = ids the first i positions gave
        self._filled: dict[str, int] = {}  # positions (prompt + output) taken in

    def window(self, req: Request, window: int) -> np.ndarray:
        """The history ids of `req`'s last `window` prompt + output positions (all when 0), read-only."""
        rid, total = req.req_id, len(req.prompt_ids) + len(req.output_ids)
        filled = self._filled.get(rid, 0)
        if rid not in self._ids or filled > total:  # new, or its tokens were replaced (a resume): start over
            self._ids[rid], self._num_ids[rid], self._kept[rid], filled = np.empty(64, dtype=np.int64), 0, [0], 0
        if filled < total:
            self._append(rid, self._tokens(req, filled, total))
        self._filled[rid] = total
        first = max(0, total - window) if window else 0
        start, end = (first, total) if self._history_ids is None else (self._kept[rid][first], self._kept[rid][total])
        view = self._ids[rid][start:end]
        view.flags.writeable = False
        return view

    def _append(self, rid: str, tokens: list[Token]) -> None:
        new: list = tokens
        if self._history_ids is not None:
            kept, new = self._kept[rid], []
            for token in tokens:
                new += self._history_ids([token], 0)
                kept.append(self._num_ids[rid] + len(new))
        ids, count = self._ids[rid], self._num_ids[rid]
        if count + len(new) > len(ids):  # doubles: a step's one new token rarely copies the buffer
            grown = np.empty(2 * (count + len(new)), dtype=np.int64)
            grown[:count] = ids[:count]
            ids = self._ids[rid] = grown
        ids[count : count + len(new)] = new
        self._num_ids[rid] = count + len(new)

    @staticmethod
    def _tokens(req: Request, start: int, end: int) -> list[Token]:
        prompt = len(req.prompt_ids)
        head = req.prompt_ids[start:end] if start < prompt else []
        return head + req.output_ids[max(0, start - prompt) : end - prompt]

    def forget(self, req_id: str) -> None:
        for table in (self._ids, self._num_ids, self._kept, self._filled):
            table.pop(req_id, None)

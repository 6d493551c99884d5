"""Prompt KV kept in its slot after the request ended, for a later request whose prompt starts the same
(a conversation's next turn: its history is the earlier prompt plus the answer and a new user turn),
pure Python. The scheduler keeps a finished or cancelled request's slot here when its family's prompt
ids are its content (`LMAdapter.reuses_prompt_kv`); in the paged layout the slot keeps the blocks of
its prompt's positions only. A new request takes the slot holding the longest common prefix (paged:
its blocks grown to the request's reservation) and prefills only the rest; a slot (and its blocks)
is given back, oldest first, when a request needs one and none is free. Each kept prompt carries its conversation key
(`llm_stage.prompt_work.next_turn_key`), which the replica reports so the Router ranks that replica
with the prefill it saves. Used by `llm_stage.scheduler.Scheduler`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llm_stage.request import Token

MIN_REUSED_POSITIONS = 16  # a shorter common prefix (a system turn's first words) is not worth a slot's history


@dataclass(frozen=True)
class KeptPrompt:
    ids: tuple[Token, ...]
    key: str  # the conversation key of the turn it was the prompt of


def common_prefix(a: tuple[Token, ...], b: list[Token]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KeptPrompts:
    """Slots holding an ended request's prompt KV, oldest first."""

    def __init__(self, min_reused: int = MIN_REUSED_POSITIONS) -> None:
        self.min_reused = min_reused
        self.by_slot: OrderedDict[int, KeptPrompt] = OrderedDict()
        self.num_reuses = 0
        self.num_reused_positions = 0

    def __len__(self) -> int:
        return len(self.by_slot)

    def keep(self, slot: int, ids: list[Token], key: str) -> None:
        self.by_slot[slot] = KeptPrompt(tuple(ids), key)

    def match(self, prompt_ids: list[Token]) -> tuple[int, int] | None:
        """(slot, positions to reuse) of the kept prompt sharing the longest prefix with `prompt_ids`, at
        least `min_reused`; at most all but the prompt's last position, whose logits the request needs."""
        best: tuple[int, int] | None = None
        for slot, kept in self.by_slot.items():
            shared = min(common_prefix(kept.ids, prompt_ids), len(prompt_ids) - 1)
            if shared >= self.min_reused and (best is None or shared > best[1]):
                best = (slot, shared)
        return best

    def take(self, slot: int, num_positions: int) -> None:
        """A request reuses `slot`'s first `num_positions`: the slot is its own now."""
        del self.by_slot[slot]
        self.num_reuses += 1
        self.num_reused_positions += num_positions

    def give_back_oldest(self) -> int:
        """The oldest kept slot, no longer kept (the scheduler frees it)."""
        slot, _ = self.by_slot.popitem(last=False)
        return slot

    def forget(self, slot: int) -> int:
        """`slot`, no longer kept (the scheduler frees it)."""
        del self.by_slot[slot]
        return slot

    def keys(self) -> tuple[str, ...]:
        """The conversation keys of the kept prompts (a copy: read from another thread for the load report)."""
        return tuple(kept.key for kept in list(self.by_slot.values()))

"""KV slot accounting (pure Python): a fixed pool of sequence slots allocated once.

The scheduler allocates a slot when it admits a request and frees it on finish or cancel;
the runner's cache tensor has one row per slot (plus one scratch row for padding).
"""

from __future__ import annotations


class SlotAllocator:
    """Hands out integer slots in [0, num_slots); free() returns them."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise KeyError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)

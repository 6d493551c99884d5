"""KV block accounting for the paged cache (pure Python): a free list of fixed-size blocks and,
per sequence slot, the blocks that hold its positions in order (its row of the block table).

The scheduler reserves a row's blocks when it admits the row (for every position the row can
reach: prompt + max_tokens, or the whole context for streamed text), so a running stream never
runs out of blocks mid-stream and nothing needs preempting; it releases them on finish, cancel,
preemption and move-out. The runner copies the rows that changed into the cache's device block
table before the next forward (`take_changed`).
"""

from __future__ import annotations


def blocks_for(num_positions: int, block_size: int) -> int:
    """Blocks that hold `num_positions` positions."""
    return -(-num_positions // block_size)


class BlockAllocator:
    """Hands out block ids in [0, num_blocks) to slots; refuses (changing nothing) when short."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_slot: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_slot = max_blocks_per_slot
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[int, list[int]] = {}
        self._changed: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_of(self, slot: int) -> list[int]:
        """The slot's blocks, position order (empty when it holds none)."""
        return list(self._owned.get(slot, ()))

    def capacity(self, slot: int) -> int:
        """Positions the slot's blocks hold."""
        return len(self._owned.get(slot, ())) * self.block_size

    def row_blocks(self, num_positions: int) -> int:
        """Blocks a row holding `num_positions` positions owns (at most a full row)."""
        return min(blocks_for(num_positions, self.block_size), self.max_blocks_per_slot)

    def extra_blocks(self, slot: int, num_positions: int) -> int:
        """Blocks the slot still needs to hold `num_positions` positions."""
        return max(0, self.row_blocks(num_positions) - len(self._owned.get(slot, ())))

    def reserve(self, slot: int, num_positions: int) -> bool:
        """Grow the slot's blocks to hold `num_positions` positions; False (nothing taken) when the
        free list is short."""
        extra = self.extra_blocks(slot, num_positions)
        if extra > len(self._free):
            return False
        if extra:
            self._owned.setdefault(slot, []).extend(self._free.pop() for _ in range(extra))
            self._changed.add(slot)
        return True

    def truncate(self, slot: int, num_positions: int) -> None:
        """Keep only the slot's blocks that hold its first `num_positions` positions; the rest go back."""
        blocks = self._owned.get(slot, [])
        keep = self.row_blocks(num_positions)
        if len(blocks) > keep:
            self._free.extend(reversed(blocks[keep:]))
            del blocks[keep:]
            self._changed.add(slot)

    def release(self, slot: int) -> None:
        """Return the slot's blocks to the free list (its table row then points at the scratch block)."""
        blocks = self._owned.pop(slot, [])
        self._free.extend(reversed(blocks))
        if blocks:
            self._changed.add(slot)

    def take_changed(self) -> list[tuple[int, list[int]]]:
        """(slot, blocks) of every slot whose blocks changed since the last call, then forgets them."""
        changed = [(slot, self.blocks_of(slot)) for slot in sorted(self._changed)]
        self._changed.clear()
        return changed

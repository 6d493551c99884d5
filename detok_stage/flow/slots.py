"""Every streamed request's flow state on one replica as pooled tensors, so a chunk round runs each
layer once for the whole batch instead of once per request.

A request holds a slot (`FlowSlot`) from its first chunk until its state is dropped (the handle's
finalizer gives the slot back, so nothing is leaked when a codec forgets a stream). Its attention
keys/values live in blocks of `BLOCK_POSITIONS` positions of one kind: tokens (the 25 Hz encoder
blocks), mel frames (the 50 Hz encoder blocks) or estimator frames (every Euler step's estimator
blocks: the same positions as mel frames, kept apart because the estimator may read a bounded
history, `EstimatorHistory`, whose blocks behind the window go back to the free list). Each attention
layer has one pool per kind, `[positions, rows, heads, dim]`; each causal conv's left input has one
pool indexed by slot, `[slots, rows, channels, width]`.

A forward over G requests builds one `SlotBatch` per kind: the requests' block tables and starts go
to the device once, and every layer then writes its new keys/values with one `index_copy_`, reads
the requests' histories with one gather and attends under one mask (a key is visible when it
exists for that request and lies before the end of the query's attention chunk). Before this, each
layer looped over the requests (about 10,700 aten ops per request per 25-token chunk at the tiny
preset): on a GPU, a launch each.

Pools grow (doubling, zero-filled) when the requests outgrow them. Masked keys weigh exactly zero,
so the pooled forward gives the per-request one's numbers up to float summation order.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

BLOCK_POSITIONS = 16  # positions per KV block
TOKENS, FRAMES, STEPS = "tokens", "frames", "steps"  # the position kinds (STEPS: the estimator's frames)
DROPPED = -1  # a block table entry whose block went back to the free list (behind a bounded history)


def blocks_for(positions: int) -> int:
    return -(-positions // BLOCK_POSITIONS)


@dataclass(frozen=True)
class EstimatorHistory:
    """Which earlier mel frames the estimator's chunk-causal attention reads.

    `window_frames` 0 (the default): every earlier frame, so the streamed mel equals the offline
    CosyVoice 2 mel, and a stream's estimator keys/values grow with its length (at the published shapes
    4.6 MB per mel frame, fp32: 56 attention blocks x K and V x 512 x 2 CFG rows x 10 Euler steps).
    `window_frames` > 0: a query in the attention chunk starting at frame c reads frames
    [0, sink_frames) and [c - window_frames, end of its chunk), as VoxServe (a 16 sink + 128 window) and
    Step-Audio 2's token2wav (prompt + ~100 frames) bound theirs: a stream's estimator memory stays
    fixed and the audio differs from the exact one (offline decoding applies the same mask, so streamed
    and offline audio still agree)."""

    sink_frames: int = 0
    window_frames: int = 0

    def __post_init__(self) -> None:
        if self.sink_frames < 0 or self.window_frames < 0:
            raise ValueError(f"estimator history needs sink and window >= 0, got {self}")

    @property
    def bounded(self) -> bool:
        return self.window_frames > 0

    def first_kept(self, chunk_start: int) -> int:
        """The first frame after the sink that a chunk starting at `chunk_start` still reads."""
        return max(self.sink_frames, chunk_start - self.window_frames)

    def visible(self, kpos: torch.Tensor, chunk_start: torch.Tensor) -> torch.Tensor:
        """Keys at `kpos` within a bounded history of a query chunk starting at `chunk_start` (broadcast)."""
        return (kpos < self.sink_frames) | (kpos >= chunk_start - self.window_frames)


class PositionBlocks:
    """Host bookkeeping of one kind's KV blocks: a free list and each slot's blocks in position order."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self.free: list[int] = []
        self.owned: dict[int, list[int]] = {}

    def hold(self, slot: int, positions: int) -> None:
        """Give `slot` blocks for positions [0, positions), growing the block count when short."""
        owned = self.owned.setdefault(slot, [])
        need = blocks_for(positions) - len(owned)
        if need > len(self.free):
            grown = max(2 * self.num_blocks, self.num_blocks + need - len(self.free), 8)
            self.free = list(range(grown - 1, self.num_blocks - 1, -1)) + self.free
            self.num_blocks = grown
        for _ in range(max(0, need)):
            owned.append(self.free.pop())

    def drop(self, slot: int, first: int, end: int) -> None:
        """Give back the slot's blocks that lie wholly in positions [first, end) (nothing reads them again)."""
        owned = self.owned.get(slot, [])
        for b in range(-(-first // BLOCK_POSITIONS), min(end // BLOCK_POSITIONS, len(owned))):
            if owned[b] != DROPPED:
                self.free.append(owned[b])
                owned[b] = DROPPED

    def release(self, slot: int) -> None:
        self.free.extend(b for b in reversed(self.owned.pop(slot, [])) if b != DROPPED)

    def held(self, slot: int) -> int:
        return sum(1 for b in self.owned.get(slot, ()) if b != DROPPED)

    def table(self, slots: list[int], width: int) -> torch.Tensor:
        """[G, width] block ids of each slot (0 past its own blocks and for dropped ones: masked positions
        read block 0)."""
        rows = [[max(b, 0) for b in self.owned.get(s, [])[:width]] for s in slots]
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)


@dataclass
class SlotBatch:
    """One forward's G requests for one position kind, as device tensors only (a CUDA graph's inputs):
    each request writes `length` positions, pool rows `write` [G * length], and reads its positions
    0..L-1, pool rows `read` [G, L]; `visible` [G, 1, length, L] says which keys each query sees,
    `query_positions` [G, length] are the positions written, `slot_index` [G] the requests' slots."""

    slots: FlowSlots
    kind: str
    write: torch.Tensor
    read: torch.Tensor
    visible: torch.Tensor
    query_positions: torch.Tensor
    slot_index: torch.Tensor
    # query minus key positions all lie in `span` (host ints); None: in (1 - L, L - 1), fixed by the
    # shapes, which a CUDA graph needs (the rel-pos encoder then projects more distances than it uses)
    span: tuple[int, int] | None = None
    # `visible` repeated per row of a request, by rows per request (every estimator layer asks for the same)
    _masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, slots: FlowSlots, kind: str, ids: list[int], starts: list[int], length: int,
              chunk: int, num_keys: int | None = None) -> SlotBatch:  # fmt: skip
        """Request g (slot `ids[g]`) adds positions [starts[g], starts[g] + length); a key is visible when
        the request holds it and it lies before the end of the query's `chunk` (0: no chunking). L is
        `num_keys` (at least the longest request's positions), so a padded L keeps shapes repeatable."""
        num_keys = max(num_keys or 0, max(starts) + length)
        device = slots.device
        table = slots.blocks[kind].table(ids, blocks_for(num_keys)).to(device, non_blocking=True)
        start = torch.tensor(starts, dtype=torch.long).to(device, non_blocking=True)
        new = start.unsqueeze(1) + torch.arange(length, device=device)  # [G, length] positions written
        keys = torch.arange(num_keys, device=device)
        exists = keys.unsqueeze(0) < (start + length).unsqueeze(1)  # [G, L]
        visible = exists.unsqueeze(1)
        if chunk > 0:
            chunk_end = (new // chunk + 1) * chunk  # [G, length]
            visible = visible & (keys.view(1, 1, -1) < chunk_end.unsqueeze(2))
        return cls(
            slots, kind, write=_pool_rows(table, new).reshape(-1), read=_pool_rows(table, keys.expand(len(ids), -1)),
            visible=visible.unsqueeze(1), query_positions=new,
            slot_index=torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True),
            span=(min(starts) - num_keys + 1, max(starts) + length - 1),
        )  # fmt: skip

    @classmethod
    def build_bounded(cls, slots: FlowSlots, kind: str, ids: list[int], starts: list[int], length: int,
                      chunk: int, history: EstimatorHistory) -> SlotBatch:  # fmt: skip
        """As `build`, for attention that reads a bounded history (`history.bounded`): request g reads its
        sink frames and the window before its attention chunk, L = sink + window + chunk keys at every
        stream length (one shape for a CUDA graph). Each request's new positions lie in one chunk."""
        if any(s // chunk != (s + length - 1) // chunk for s in starts):
            raise ValueError(f"a bounded-history round stays inside one attention chunk of {chunk} (starts {starts})")
        device = slots.device
        sink, window = history.sink_frames, history.window_frames
        chunk_starts = [s // chunk * chunk for s in starts]
        width = blocks_for(max(max(chunk_starts) + chunk, sink))
        table = slots.blocks[kind].table(ids, width).to(device, non_blocking=True)
        start = torch.tensor(starts, dtype=torch.long).to(device, non_blocking=True)
        chunk_start = torch.tensor(chunk_starts, dtype=torch.long).to(device, non_blocking=True)
        new = start.unsqueeze(1) + torch.arange(length, device=device)
        j = torch.arange(sink + window + chunk, device=device)
        keys = torch.where(j < sink, j, chunk_start.unsqueeze(1) - window + (j - sink))  # [G, L] positions read
        in_sink = (j < sink).unsqueeze(0)
        exists = (keys >= 0) & (keys < (start + length).unsqueeze(1)) & (in_sink | (keys >= sink))
        return cls(
            slots, kind, write=_pool_rows(table, new).reshape(-1), read=_pool_rows(table, keys.clamp(min=0)),
            visible=exists[:, None, None, :], query_positions=new,
            slot_index=torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True),
        )  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        return [self.write, self.read, self.visible, self.query_positions, self.slot_index]

    @classmethod
    def of_tensors(cls, slots: FlowSlots, kind: str, tensors: list[torch.Tensor],
                   span: tuple[int, int] | None = None) -> SlotBatch:  # fmt: skip
        return cls(slots, kind, *tensors, span=span)

    @property
    def length(self) -> int:
        return self.query_positions.shape[1]

    @property
    def num_keys(self) -> int:
        return self.read.shape[1]

    @property
    def num_requests(self) -> int:
        return self.read.shape[0]

    def keys_values(self, layer: object, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [G * R, H, length, D] as the requests' next positions in `layer`'s pools; returns
        every request's keys and values [G * R, H, L, D] (positions 0..L-1; masked where `visible` says)."""
        g = self.num_requests
        rows, heads, dim = k.shape[0] // g, k.shape[1], k.shape[3]
        k_pool, v_pool = self.slots.kv_pools(self.kind, layer, (rows, heads, dim), k)

        def store(pool: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            new = x.view(g, rows, heads, self.length, dim).permute(0, 3, 1, 2, 4).reshape(-1, rows, heads, dim)
            pool.index_copy_(0, self.write, new)
            history = pool[self.read]  # [G, L, R, H, D]
            return history.permute(0, 2, 3, 1, 4).reshape(g * rows, heads, self.num_keys, dim)

        return store(k_pool, k), store(v_pool, v)

    def mask_rows(self, rows: int) -> torch.Tensor:
        """`visible` repeated for each of a request's R rows: [G * R, 1, length, L] (made once per batch)."""
        if rows == 1:
            return self.visible
        if rows not in self._masks:
            self._masks[rows] = self.visible.repeat_interleave(rows, dim=0)
        return self._masks[rows]

    def conv_left(self, name: str, x: torch.Tensor, width: int) -> torch.Tensor:
        """x [G * R, C, T] preceded by each request's last `width` inputs to conv `name` (zeros at its
        start); those of the joined input become its next left context. -> [G * R, C, width + T]."""
        g = self.num_requests
        rows, channels = x.shape[0] // g, x.shape[1]
        pool = self.slots.conv_pool(name, (rows, channels, width), x)
        left = pool.index_select(0, self.slot_index).view(g * rows, channels, width)
        joined = torch.cat([left, x], dim=2)
        pool.index_copy_(0, self.slot_index, joined[:, :, -width:].reshape(g, rows, channels, width))
        return joined


@dataclass(eq=False)
class FlowSlot:
    """A request's place in the pools; the slot goes back when the handle is dropped."""

    id: int
    pools: FlowSlots

    def hold(self, tokens: int) -> None:
        """Blocks for the request's first `tokens` tokens (and their mel frames, for encoder and estimator)."""
        self.pools.blocks[TOKENS].hold(self.id, tokens)
        self.pools.blocks[FRAMES].hold(self.id, tokens * self.pools.frames_per_token)
        self.pools.blocks[STEPS].hold(self.id, tokens * self.pools.frames_per_token)

    def forget_behind(self, history: EstimatorHistory, next_chunk_start: int) -> None:
        """Give back the estimator blocks no later chunk reads (those behind a bounded history's window)."""
        if history.bounded:
            self.pools.blocks[STEPS].drop(self.id, history.sink_frames, history.first_kept(next_chunk_start))

    @property
    def nbytes(self) -> int:
        return self.pools.slot_nbytes(self.id)


class FlowSlots:
    """The pools of one flow model on one device."""

    def __init__(self, device: torch.device | str, frames_per_token: int) -> None:
        self.device = torch.device(device)
        self.frames_per_token = frames_per_token
        self.blocks = {TOKENS: PositionBlocks(), FRAMES: PositionBlocks(), STEPS: PositionBlocks()}
        self.kv: dict[tuple[str, object], tuple[torch.Tensor, torch.Tensor]] = {}
        self.conv: dict[str, torch.Tensor] = {}
        self.num_slots = 0
        self.free_slots: list[int] = []
        self.open_slots: set[int] = set()
        self.generation = 0  # bumped when a pool is reallocated (CUDA graphs captured on the old ones are stale)
        self._fitted: tuple[int, ...] | None = None  # block and slot counts the pools last grew to

    def open(self) -> FlowSlot:
        """A slot with zero conv history (its KV positions are written before they are read)."""
        if not self.free_slots:
            self.free_slots = list(range(max(2 * self.num_slots, 8) - 1, self.num_slots - 1, -1))
            self.num_slots = max(2 * self.num_slots, 8)
        slot_id = self.free_slots.pop()
        with torch.inference_mode():  # the pools are made in the codec's inference mode
            for pool in self.conv.values():
                if slot_id < pool.shape[0]:
                    pool[slot_id].zero_()
        self.open_slots.add(slot_id)
        handle = FlowSlot(slot_id, self)
        weakref.finalize(handle, self._close, slot_id)
        return handle

    def _close(self, slot_id: int) -> None:
        for blocks in self.blocks.values():
            blocks.release(slot_id)
        self.open_slots.discard(slot_id)
        self.free_slots.append(slot_id)

    # ---- pools (created on first use, grown when the block or slot counts outgrow them) ----------

    def kv_pools(self, kind: str, layer: object, shape: tuple[int, int, int], like: torch.Tensor):
        positions = self.blocks[kind].num_blocks * BLOCK_POSITIONS
        key = (kind, layer)
        pools = self.kv.get(key)
        if pools is None or pools[0].shape[0] < positions:
            pools = tuple(_grown(p, positions, shape, like) for p in (pools or (None, None)))
            self.kv[key] = pools
            self.generation += 1
        return pools

    def conv_pool(self, name: str, shape: tuple[int, int, int], like: torch.Tensor) -> torch.Tensor:
        pool = self.conv.get(name)
        if pool is None or pool.shape[0] < self.num_slots:
            pool = _grown(pool, self.num_slots, shape, like)
            self.conv[name] = pool
            self.generation += 1
        return pool

    def fit(self) -> None:
        """Grow every pool made so far to the current block and slot counts (before a CUDA graph runs:
        a pool reallocated inside a capture would leave the graph on the old one). Pools made later are
        made at the counts of their time, so nothing is to do while the counts stay."""
        counts = (*(blocks.num_blocks for blocks in self.blocks.values()), self.num_slots)
        if counts == self._fitted:
            return
        self._fitted = counts
        for kind, layer in list(self.kv):
            k, _ = self.kv[(kind, layer)]
            self.kv_pools(kind, layer, tuple(k.shape[1:]), k)
        for name, pool in list(self.conv.items()):
            self.conv_pool(name, tuple(pool.shape[1:]), pool)

    def slot_nbytes(self, slot_id: int) -> int:
        """Bytes of the slot's KV blocks in every pool made so far."""
        total = 0
        for (kind, _), (k, _v) in self.kv.items():
            blocks = self.blocks[kind].held(slot_id)
            total += 2 * blocks * BLOCK_POSITIONS * k[0].numel() * k.element_size()
        return total

    @property
    def nbytes(self) -> int:
        kv = sum(k.nbytes + v.nbytes for k, v in self.kv.values())
        return kv + sum(p.nbytes for p in self.conv.values())


def _pool_rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Pool rows of each request's `positions` [G, n] through its block `table` [G, blocks]."""
    block = torch.gather(table, 1, torch.div(positions, BLOCK_POSITIONS, rounding_mode="floor"))
    return block * BLOCK_POSITIONS + positions % BLOCK_POSITIONS


def _grown(pool: torch.Tensor | None, length: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """`pool` extended with zeros to `length` entries of `shape` (a new zero pool when None)."""
    fresh = torch.zeros(length - (0 if pool is None else pool.shape[0]), *shape, dtype=like.dtype, device=like.device)
    return fresh if pool is None else torch.cat([pool, fresh])

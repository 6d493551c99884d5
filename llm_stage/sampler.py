"""Per-request sampling over a batch of logits rows.

Each row has its own temperature, top-k, top-p, min-p, windowed repetition penalty,
repetition-aware sampling (`llm_stage.ras`) and seed. Rows may cover a candidate subset of the
vocabulary (`cand_ids`); the result is always a vocabulary id. Called by the LLM engine after the
model forward. Every draw is an exponential race over the row's kept columns with counter-based
uniforms (`llm_stage.draws`: keyed by the row's seed and draw counter), so a seeded row draws the
same tokens in any batch, on any replica, after a resume.

On an accelerator the whole batch samples on the device with no host synchronisation
(`sample_on_device`: the rows' parameters and penalty histories go over in one non-blocking copy,
the filters run on each row's fully sorted values, no per-row branches); the caller reads the
tokens back once. CPU logits are sampled in numpy (`host_sampler`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from core.messages import SamplingParams
from core.transfer import to_device
from llm_stage.draws import row_key, row_keys, seed_halves, uniforms
from llm_stage.host_sampler import sample_on_host
from llm_stage.ras import sample_repetition_aware


@dataclass
class SamplingRow:
    params: SamplingParams
    history: Sequence[int]  # token ids the repetition penalty looks at (a list, or an int64 array)
    seed: int = 0  # the request's seed (a random one for unseeded requests)
    counter: int = 0  # this draw's counter (`llm_stage.draws.draw_counter`)
    recent: list[int] = field(default_factory=list)  # the last `ras_window` generated ids (RAS rows)

    @property
    def key(self) -> int:
        """32 bits for (seed, counter) that this draw's uniforms hash with each column."""
        return row_key(self.seed, self.counter)


def row_keys_np(rows: list[SamplingRow]) -> np.ndarray:
    """Every row's `key` in one pass of numpy (int64 under 2^32 throughout: `llm_stage.draws`)."""
    halves = np.array([(*seed_halves(r.seed), r.counter) for r in rows], dtype=np.int64).reshape(-1, 3)
    return row_keys(halves[:, 0], halves[:, 1], halves[:, 2])


def sample(
    logits: torch.Tensor,  # [B, C] float
    cand_ids: torch.Tensor | None,  # [B, C] vocab id of each column, or None for the full vocab
    rows: list[SamplingRow],
    vocab_size: int | None = None,
    table: RowTable | None = None,
) -> list[int]:
    """Vocabulary id per row. CPU logits are sampled in numpy (`host_sampler`: same semantics, a
    fraction of torch's per-op overhead); accelerator logits on their device, read back once.
    Rows with repetition-aware sampling are drawn by `llm_stage.ras`. `vocab_size`: ids in
    `cand_ids` are below it (the LM head's rows), so the device penalty needs no read-back.
    `table`: `rows`' RowTable built ahead (during the forward), for the device path."""
    ras = [b for b, row in enumerate(rows) if row.params.is_repetition_aware]
    if not ras:
        return _sample_plain(logits, cand_ids, rows, vocab_size, table)
    plain = [b for b, row in enumerate(rows) if not row.params.is_repetition_aware]
    picked = [0] * len(rows)
    for group, draw in ((plain, _sample_plain), (ras, _sample_ras)):
        if group:
            group_cand = None if cand_ids is None else cand_ids[group]
            ids = draw(logits[group], group_cand, [rows[b] for b in group], vocab_size, None)
            for b, token in zip(group, ids, strict=True):
                picked[b] = token
    return picked


def _sample_plain(
    logits: torch.Tensor,
    cand_ids: torch.Tensor | None,
    rows: list[SamplingRow],
    vocab_size: int | None,
    table: RowTable | None = None,
) -> list[int]:
    if logits.device.type == "cpu":
        return sample_on_host(logits, cand_ids, rows)
    return sample_on_device(logits, cand_ids, rows, vocab_size, table).tolist()  # the step's one wait for the GPU


def _sample_ras(
    logits: torch.Tensor,
    cand_ids: torch.Tensor | None,
    rows: list[SamplingRow],
    vocab_size: int | None,
    table: RowTable | None = None,
) -> list[int]:
    """RAS rows: the repetition penalty on the logits' device without a read-back (`penalize_on_device`;
    `vocab_size` None: the candidates' largest id bounds it, read back once), then `llm_stage.ras`."""
    logits = logits.float().clone()
    if vocab_size is None:
        vocab_size = logits.shape[1] if cand_ids is None else int(cand_ids.max()) + 1
    penalize_on_device(logits, cand_ids, RowTable.of(rows, logits.shape[1], logits.device), vocab_size)
    return sample_repetition_aware(logits, cand_ids, rows)


@dataclass(frozen=True)
class RowTable:
    """The rows' sampling parameters on the logits' device ([B, 1] each; `history` [B, W], -1 = none),
    built on the host and sent in one non-blocking copy."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    penalty: torch.Tensor
    keys: torch.Tensor  # [B] int64
    greedy: torch.Tensor  # [B] bool
    history: torch.Tensor  # [B, W] int64

    @classmethod
    def of(cls, rows: list[SamplingRow], width: int, device: torch.device) -> RowTable:
        """`width`: the logits' columns, the top-k of rows with none; 0 = not known yet (the table is
        built ahead of the logits): `with_width` fills it in on the device."""
        penalised = [r.history if r.params.repetition_penalty != 1.0 else [] for r in rows]
        history_width = max(1, max(len(h) for h in penalised))
        table = np.full((len(rows), 7 + history_width), -1.0)  # float64 holds ids and 32-bit keys exactly
        for b, row in enumerate(rows):
            p = row.params
            table[b, :7] = (p.temperature, p.top_k or width, p.top_p, p.min_p, p.repetition_penalty, 0, p.is_greedy)
            table[b, 7 : 7 + len(penalised[b])] = penalised[b]
        table[:, 5] = row_keys_np(rows)
        on_device = to_device(torch.from_numpy(table), device)
        floats = on_device[:, :5].float()
        history = on_device[:, 7:].long()
        return cls(
            floats[:, 0:1], on_device[:, 1:2].long(), floats[:, 2:3], floats[:, 3:4], floats[:, 4:5],
            on_device[:, 5].long(), on_device[:, 6] > 0, history,
        )  # fmt: skip

    def with_width(self, width: int) -> RowTable:
        """The table with top-k 0 (a table built before the logits' width was known) set to `width`."""
        return dataclasses.replace(self, top_k=torch.where(self.top_k > 0, self.top_k, width))


def penalize_on_device(logits: torch.Tensor, cand_ids: torch.Tensor | None, table: RowTable, vocab_size: int) -> None:
    """In place: logit / p when positive, logit * p when negative, where the column's id is in the
    row's history; a scatter into a [B, vocab + 2] mask (column vocab takes the histories' padding,
    vocab + 1, never set, the candidates' padding), no read-back. `vocab_size`: every id of
    `cand_ids` and of the histories is below it."""
    rows, width = logits.shape
    span = width if cand_ids is None else vocab_size
    history = table.history
    ids = torch.where((history >= 0) & (history < span), history, span)
    seen_ids = torch.zeros(rows, span + 2, dtype=torch.bool, device=logits.device)
    seen_ids.scatter_(1, ids, True)
    if cand_ids is None:
        seen = seen_ids[:, :width]
    else:
        seen = seen_ids.gather(1, torch.where((cand_ids >= 0) & (cand_ids < span), cand_ids, span + 1))
    penalised = torch.where(logits > 0, logits / table.penalty, logits * table.penalty)
    torch.where(seen, penalised, logits, out=logits)


def sample_on_device(
    logits: torch.Tensor,
    cand_ids: torch.Tensor | None,
    rows: list[SamplingRow],
    vocab_size: int | None = None,
    table: RowTable | None = None,
) -> torch.Tensor:
    """[B] vocabulary ids on the logits' device, nothing read back (runs on CPU tensors too).

    Greedy rows take the argmax; the rest race: argmax over the kept columns of scaled logit - log E,
    E = -log U with U from the row's key and the column (`llm_stage.draws`), i.e. a draw from the
    filtered distribution that float noise in the logits almost never moves. The kept columns are
    those at or above the smallest value the row's top-k, top-p and min-p keep on its sorted values.
    """
    logits = logits.float().clone()
    if table is None:
        table = RowTable.of(rows, logits.shape[1], logits.device)
    else:
        table = table.with_width(logits.shape[1])
    if any(r.params.repetition_penalty != 1.0 and len(r.history) for r in rows):
        if cand_ids is not None and vocab_size is None:
            vocab_size = int(cand_ids.max()) + 1  # (a read-back: the engine passes its head's rows)
        penalize_on_device(logits, cand_ids, table, vocab_size or logits.shape[1])
    picked = logits.argmax(dim=-1) if all(r.params.is_greedy for r in rows) else pick_on_device(logits, table)
    if cand_ids is not None:
        picked = cand_ids.gather(1, picked.unsqueeze(1)).squeeze(1)
    return picked


class DrawTable(Protocol):
    """What a device draw reads per row: [B, 1] temperature / top_k / top_p / min_p, [B] keys and greedy
    (`RowTable`, or one codebook of `llm_stage.inner_loop.InnerTable`)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    keys: torch.Tensor
    greedy: torch.Tensor


def pick_on_device(logits: torch.Tensor, table: DrawTable) -> torch.Tensor:
    """[B] column per row with no branch on the host (so a CUDA graph can hold it): greedy rows take the
    argmax, the rest the exponential race over their kept columns (`sample_on_device`'s draw)."""
    greedy_pick = logits.argmax(dim=-1)
    scaled = logits / torch.where(table.greedy.unsqueeze(1), 1.0, table.temperature)
    kept = kept_columns(scaled, table)
    exponentials = uniforms(table.keys, logits.shape[1]).log().neg()
    race = torch.where(kept, scaled - exponentials.log(), float("-inf"))
    return torch.where(table.greedy, greedy_pick, race.argmax(dim=-1))


def kept_columns(scaled: torch.Tensor, filters: DrawTable) -> torch.Tensor:
    """[B, C] bool: the columns top-k / top-p / min-p keep, found on each row's sorted values (a
    column tied with the smallest kept value is kept, as transformers' top-k and min-p keep ties)."""
    descending = scaled.sort(dim=-1, descending=True).values
    kept_sorted = _filter_sorted(descending, filters)
    kept_count = torch.isfinite(kept_sorted).sum(dim=-1, keepdim=True).clamp(min=1)
    return scaled >= descending.gather(1, kept_count - 1)


def _filter_sorted(sorted_logits: torch.Tensor, filters: DrawTable) -> torch.Tensor:
    """Top-k, then top-p over the top-k mass, then min-p, on logits sorted descending per row;
    returns them with the cut ranks at -inf. `filters`: [B, 1] top_k / top_p / min_p."""
    ranks = torch.arange(sorted_logits.shape[1], device=sorted_logits.device).unsqueeze(0)
    masked = sorted_logits.masked_fill(ranks >= filters.top_k, float("-inf"))
    probs = masked.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    masked = masked.masked_fill(mass_before > filters.top_p, float("-inf"))
    probs = masked.softmax(dim=-1)
    return masked.masked_fill(probs < filters.min_p * probs[:, :1], float("-inf"))

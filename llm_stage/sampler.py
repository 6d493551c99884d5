"""Per-request sampling over a batch of logits rows.

Each row has its own temperature, top-k, top-p, min-p, windowed repetition penalty,
repetition-aware sampling (`llm_stage.ras`) and optional seed. Rows may cover a candidate
subset of the vocabulary (`cand_ids`); the result is always a vocabulary id. Called by the
LLM engine after the model forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from core.messages import SamplingParams
from llm_stage.host_sampler import TINY_UNIFORM, history_pairs, sample_on_host
from llm_stage.ras import sample_repetition_aware


@dataclass
class SamplingRow:
    params: SamplingParams
    history: list[int]  # token ids the repetition penalty looks at
    generator: torch.Generator | None
    recent: list[int] = field(default_factory=list)  # the last `ras_window` generated ids (RAS rows)


def apply_repetition_penalty(logits: torch.Tensor, cand_ids: torch.Tensor | None, rows: list[SamplingRow]) -> None:
    """In place: logit / p when positive, logit * p when negative, for ids seen in the row's history.

    One scatter of every (row, history id) into a [B, V] mask (repeats just set a bit twice), a
    gather by candidate column, then the penalty on the seen columns only: no per-row set
    building or intersection, no full-width arithmetic on the hot path.
    """
    pairs = history_pairs(rows)
    if pairs is None:
        return
    row_of, tokens = pairs
    seen = _seen_columns(logits, cand_ids, torch.from_numpy(row_of), torch.from_numpy(tokens))
    hit_rows, hit_cols = seen.nonzero(as_tuple=True)
    values = logits[hit_rows, hit_cols]
    penalties = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype, device=logits.device)
    penalty = penalties[hit_rows]
    logits[hit_rows, hit_cols] = torch.where(values > 0, values / penalty, values * penalty)


def _seen_columns(
    logits: torch.Tensor, cand_ids: torch.Tensor | None, row_of: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """[B, C] bool: which logits columns hold an id of the row's history."""
    device = logits.device
    row_of, tokens = row_of.to(device), tokens.to(device)
    if cand_ids is None:
        keep = tokens < logits.shape[1]
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)
        seen[row_of[keep], tokens[keep]] = True
        return seen
    vocab = max(int(cand_ids.max()), int(tokens.max())) + 1
    seen_ids = torch.zeros(logits.shape[0], vocab, dtype=torch.bool, device=device)
    seen_ids[row_of, tokens] = True
    return seen_ids.gather(1, cand_ids.clamp(min=0)) & (cand_ids >= 0)


SHORTLIST = 64  # a draw first looks at each row's 64 best columns; it sorts the full row only when needed


@dataclass(frozen=True)
class _Filters:
    """Per-row temperature, top-k (the row width when off), top-p and min-p as [B, 1] tensors."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    @classmethod
    def of(cls, rows: list[SamplingRow], width: int, device: torch.device | str = "cpu") -> _Filters:
        p = [r.params for r in rows]
        values = [[q.temperature, q.top_k or width, q.top_p, q.min_p] for q in p]
        table = torch.tensor(values, dtype=torch.float64, device=device)
        return cls(table[:, 0:1].float(), table[:, 1:2].long(), table[:, 2:3].float(), table[:, 3:4].float())

    def select(self, index: list[int]) -> _Filters:
        return _Filters(self.temperature[index], self.top_k[index], self.top_p[index], self.min_p[index])


def _filter_sorted(sorted_logits: torch.Tensor, filters: _Filters, log_norm: torch.Tensor | None = None):
    """Top-k, then top-p, then min-p on logits sorted descending per row; returns masked logits.

    `log_norm` ([B, 1]): log of the top-k mass when `sorted_logits` is only the head of each row.
    """
    ranks = torch.arange(sorted_logits.shape[1], device=sorted_logits.device).unsqueeze(0)
    masked = sorted_logits.masked_fill(ranks >= filters.top_k, float("-inf"))
    probs = masked.softmax(dim=-1) if log_norm is None else (masked - log_norm).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    masked = masked.masked_fill(mass_before > filters.top_p, float("-inf"))
    probs = masked.softmax(dim=-1)
    return masked.masked_fill(probs < filters.min_p * probs[:, :1], float("-inf"))


def _draw(probs: torch.Tensor, rows: list[SamplingRow], default: torch.Generator) -> torch.Tensor:
    """One categorical draw per row as argmax(p / E), E = -log U ~ Exp(1) with U from the row's own
    generator (seeded requests stay reproducible whatever they are batched with); one batched
    argmax. Unlike an inverse-CDF search this is not thrown by float noise in the probabilities
    (the host sampler races the same way).
    (-log of a uniform: 3x cheaper than `exponential_` on CPU; U is floored at the smallest normal
    float, so E is finite and positive.)"""
    width = probs.shape[1]
    uniform = torch.stack([torch.rand(width, generator=row.generator or default) for row in rows]).to(probs.device)
    return (probs / uniform.clamp_(min=TINY_UNIFORM).log_().neg_()).argmax(dim=-1)


def _sorted_descending(values: torch.Tensor) -> torch.Tensor:
    """Each row's values sorted descending, no indices. On CPU numpy's SIMD sort of values alone
    is ~10x faster than `torch.sort` (which always sorts an index array along)."""
    if values.device.type != "cpu":
        return values.sort(dim=-1, descending=True).values
    return torch.from_numpy(-np.sort(-values.numpy(), axis=-1))


def _filter_full_width(values: torch.Tensor, filters: _Filters) -> torch.Tensor:
    """Top-k / top-p / min-p on unsorted rows: the filters run on each row's sorted values, which
    give the row's smallest kept value; columns below it are masked. (A column tied with that
    value is kept, as transformers' top-k and min-p keep ties.)"""
    kept_sorted = _filter_sorted(_sorted_descending(values), filters)
    kept_count = torch.isfinite(kept_sorted).sum(dim=-1, keepdim=True)
    smallest_kept = kept_sorted.gather(1, kept_count - 1)
    return values.masked_fill(values < smallest_kept, float("-inf"))


def _shortlist_log_norm(head: torch.Tensor, scaled: torch.Tensor, filters: _Filters) -> torch.Tensor:
    """[B, 1] log of each row's top-k mass: over the head when top-k fits in it, else the whole row."""
    width = head.shape[1]
    past_top_k = torch.arange(width, device=head.device).unsqueeze(0) >= filters.top_k
    head_lse = head.masked_fill(past_top_k, float("-inf")).logsumexp(-1, True)
    return torch.where(filters.top_k <= width, head_lse, scaled.logsumexp(-1, True))


def _kept_within_head(head: torch.Tensor, log_norm: torch.Tensor, filters: _Filters, width: int) -> list[bool]:
    """Per row: do top-k / top-p / min-p cut every column after the head? (Then the head decides.)"""
    short = head.shape[1]
    probs = (head - log_norm).exp()
    cut_by_p = (probs.sum(-1, keepdim=True) > filters.top_p) | (probs[:, -1:] < filters.min_p * probs[:, :1])
    fits = (filters.top_k <= short) | ((filters.top_k >= width) & cut_by_p) | (short >= width)
    return fits.squeeze(1).tolist()


def _head_decides(
    head: torch.Tensor, scaled: torch.Tensor, rows: list[SamplingRow], filters: _Filters
) -> tuple[list[bool], torch.Tensor]:
    """Which rows draw from their head, and each row's log normaliser for it. Rows with only
    top-p (Orpheus' default) take a short path: the head decides iff its mass passes top-p."""
    if all(not r.params.top_k and not r.params.min_p for r in rows):
        log_norm = scaled.logsumexp(-1, True)
        return ((head - log_norm).exp().sum(-1, keepdim=True) > filters.top_p).squeeze(1).tolist(), log_norm
    log_norm = _shortlist_log_norm(head, scaled, filters)
    return _kept_within_head(head, log_norm, filters, scaled.shape[1]), log_norm


def _sample_scaled(scaled: torch.Tensor, rows: list[SamplingRow], filters: _Filters, default: torch.Generator):
    """Column drawn per row from temperature-scaled logits under the row's top-k / top-p / min-p.

    The draw runs over the row's SHORTLIST best columns when the filters provably cut everything
    after them (the usual case for a trained model's speech tokens), else over the whole row
    masked below its smallest kept value (`_filter_full_width`): same distribution, no sort with
    indices per step. Each row consumes a fixed amount of its generator.
    """
    head, head_cols = scaled.topk(min(SHORTLIST, scaled.shape[1]), dim=-1)  # sorted descending
    fits, log_norm = _head_decides(head, scaled, rows, filters)
    picked = torch.empty(len(rows), dtype=torch.long, device=scaled.device)
    for use_head in (True, False):
        index = [b for b, f in enumerate(fits) if f == use_head]
        if not index:
            continue
        whole = len(index) == len(rows)  # one group: no row selection
        group = filters if whole else filters.select(index)
        if use_head:
            values, columns = (head, head_cols) if whole else (head[index], head_cols[index])
            probs = _filter_sorted(values, group, log_norm if whole else log_norm[index]).softmax(dim=-1)
            draws = _draw(probs, [rows[b] for b in index], default)
            picked[index] = columns.gather(1, draws.unsqueeze(1)).squeeze(1)
        else:
            probs = _filter_full_width(scaled if whole else scaled[index], group).softmax(dim=-1)
            picked[index] = _draw(probs, [rows[b] for b in index], default)
    return picked


def sample(
    logits: torch.Tensor,  # [B, C] float
    cand_ids: torch.Tensor | None,  # [B, C] vocab id of each column, or None for the full vocab
    rows: list[SamplingRow],
    default_generator: torch.Generator,
) -> list[int]:
    """Vocabulary id per row. CPU logits are sampled in numpy (`host_sampler`: same semantics,
    a fraction of torch's per-op overhead); accelerator logits stay on their device. Rows with
    repetition-aware sampling are drawn by `llm_stage.ras`."""
    ras = [b for b, row in enumerate(rows) if row.params.is_repetition_aware]
    if not ras:
        return _sample_plain(logits, cand_ids, rows, default_generator)
    plain = [b for b, row in enumerate(rows) if not row.params.is_repetition_aware]
    picked = [0] * len(rows)
    for group, draw in ((plain, _sample_plain), (ras, _sample_ras)):
        if group:
            group_cand = None if cand_ids is None else cand_ids[group]
            ids = draw(logits[group], group_cand, [rows[b] for b in group], default_generator)
            for b, token in zip(group, ids, strict=True):
                picked[b] = token
    return picked


def _sample_plain(
    logits: torch.Tensor, cand_ids: torch.Tensor | None, rows: list[SamplingRow], default_generator: torch.Generator
) -> list[int]:
    if logits.device.type == "cpu":
        return sample_on_host(logits, cand_ids, rows, default_generator)
    return sample_on_device(logits, cand_ids, rows, default_generator)


def _sample_ras(
    logits: torch.Tensor, cand_ids: torch.Tensor | None, rows: list[SamplingRow], default_generator: torch.Generator
) -> list[int]:
    logits = logits.float().clone()
    apply_repetition_penalty(logits, cand_ids, rows)
    return sample_repetition_aware(logits, cand_ids, rows, default_generator)


def sample_on_device(
    logits: torch.Tensor, cand_ids: torch.Tensor | None, rows: list[SamplingRow], default_generator: torch.Generator
) -> list[int]:
    """The torch path: runs wherever the logits are (also on CPU, where `sample` prefers numpy)."""
    logits = logits.float().clone()
    apply_repetition_penalty(logits, cand_ids, rows)
    picked = logits.argmax(dim=-1)  # [B]
    random_rows = [b for b, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        sub_rows = [rows[b] for b in random_rows]
        filters = _Filters.of(sub_rows, logits.shape[1], logits.device)
        scaled = logits[random_rows] / filters.temperature
        picked[random_rows] = _sample_scaled(scaled, sub_rows, filters, default_generator)
    if cand_ids is not None:
        picked = cand_ids.gather(1, picked.unsqueeze(1)).squeeze(1)
    return picked.tolist()

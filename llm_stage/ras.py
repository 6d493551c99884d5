"""Repetition-aware sampling (RAS), CosyVoice 2's default, for rows with `SamplingParams.ras_window`.

A nucleus draw as CosyVoice's: top-k, and top-p over the whole distribution (not over the top-k
mass), plus our min-p. When the drawn id already occurs at least `ras_tau * ras_window` times in
the row's last `ras_window` generated ids, it is redrawn from the whole distribution without that
id. Each draw takes one uniform from the row's key (`llm_stage.draws`: lane 0 for the draw,
lane 1 for a redraw), so seeded rows reproduce whatever they are batched with. Called by
`llm_stage.sampler.sample` on (penalised) float logits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from core.messages import SamplingParams
from llm_stage.draws import uniforms

if TYPE_CHECKING:
    from llm_stage.sampler import SamplingRow


def repeat_threshold(params: SamplingParams) -> int:
    """Occurrences in the window that trigger a redraw: ceil(ras_tau * ras_window), at least 1
    (the product is rounded first, so a float32 tau from the wire, 0.1000000015, still gives 1 of 10)."""
    return max(1, math.ceil(round(params.ras_tau * params.ras_window, 6)))


def _uniforms(rows: list[SamplingRow], lane: int, device: torch.device) -> torch.Tensor:
    """[R] one uniform per row: its key's uniform at column `lane`."""
    keys = torch.tensor([row.key for row in rows], dtype=torch.long)
    return uniforms(keys, lane + 1)[:, lane].to(device)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[R] column drawn per row with probability proportional to `weights` [R, W] (>= 0, some > 0)."""
    cdf = weights.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=weights.shape[1] - 1)


def _nucleus(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[R] column per row: rank r is kept while r < top_k and the mass of the ranks above it is < top_p."""
    width = probs.shape[1]
    params = [row.params for row in rows]
    head_width = min(width, max(p.top_k or width for p in params))
    head, columns = probs.topk(head_width, dim=-1)  # [R, K] sorted descending
    table = torch.tensor([[p.top_k or width, p.top_p, p.min_p] for p in params], dtype=torch.float64)
    top_k, top_p, min_p = (table[:, i : i + 1].to(probs.device, probs.dtype) for i in range(3))
    ranks = torch.arange(head_width, device=probs.device).unsqueeze(0)
    mass_above = head.cumsum(dim=-1) - head
    keep = (ranks < top_k) & (mass_above < top_p) & (head >= min_p * head[:, :1])
    keep[:, 0] = True
    drawn = _inverse_cdf(head * keep, _uniforms(rows, 0, probs.device))
    return columns.gather(1, drawn.unsqueeze(1)).squeeze(1)


def _is_repeat(row: SamplingRow, token: int) -> bool:
    return sum(1 for t in row.recent if t == token) >= repeat_threshold(row.params)


def sample_repetition_aware(
    logits: torch.Tensor,  # [R, C] float, penalties applied
    cand_ids: torch.Tensor | None,  # [R, C] vocab id of each column, or None
    rows: list[SamplingRow],
) -> list[int]:
    """Vocabulary id per row: the nucleus draw, or its redraw when it repeats too often."""
    temperature = torch.tensor([[r.params.temperature] for r in rows], dtype=logits.dtype, device=logits.device)
    probs = (logits / temperature).softmax(dim=-1)
    columns = _nucleus(probs, rows)

    def vocab_ids(cols: torch.Tensor) -> list[int]:
        return (cols if cand_ids is None else cand_ids.gather(1, cols.unsqueeze(1)).squeeze(1)).tolist()

    picked = vocab_ids(columns)
    repeats = [b for b, row in enumerate(rows) if _is_repeat(row, picked[b])]
    if not repeats:
        return picked
    index = torch.tensor(repeats, device=probs.device)
    rest = probs[index].scatter(1, columns[index].unsqueeze(1), 0.0)  # the whole distribution without it
    redrawn = _inverse_cdf(rest, _uniforms([rows[b] for b in repeats], 1, probs.device))
    has_rest = rest.sum(dim=-1) > 0  # nothing else left (e.g. a forced id): keep the draw
    columns[index] = torch.where(has_rest, redrawn, columns[index])
    return vocab_ids(columns)

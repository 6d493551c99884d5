"""Per-request sampling over a batch of logits rows.

Each row has its own temperature, top-k, top-p, min-p, windowed repetition penalty and
optional seed. Rows may cover a candidate subset of the vocabulary (`cand_ids`); the
result is always a vocabulary id. Called by the LLM engine after the model forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.types import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    history: list[int]  # token ids the repetition penalty looks at
    generator: torch.Generator | None


def apply_repetition_penalty(logits: torch.Tensor, cand_ids: torch.Tensor | None, rows: list[SamplingRow]) -> None:
    """In place: logit / p when positive, logit * p when negative, for ids seen in the row's history.

    One scatter of every (row, seen id) into a [B, V] mask, then a gather by candidate column:
    no per-row set intersection on the hot path.
    """
    row_ids, token_ids = [], []
    for b, row in enumerate(rows):
        if row.params.repetition_penalty != 1.0 and row.history:
            seen = set(row.history)
            row_ids.extend([b] * len(seen))
            token_ids.extend(seen)
    if not row_ids:
        return
    rows_t = torch.tensor(row_ids, device=logits.device)
    tokens_t = torch.tensor(token_ids, device=logits.device)
    if cand_ids is None:
        keep = tokens_t < logits.shape[1]
        seen_cols = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        seen_cols[rows_t[keep], tokens_t[keep]] = True
    else:
        vocab = max(int(cand_ids.max()), int(tokens_t.max())) + 1
        seen_ids = torch.zeros(logits.shape[0], vocab, dtype=torch.bool, device=logits.device)
        seen_ids[rows_t, tokens_t] = True
        seen_cols = seen_ids.gather(1, cand_ids.clamp(min=0)) & (cand_ids >= 0)
    penalty = torch.tensor([r.params.repetition_penalty for r in rows], device=logits.device).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(seen_cols, penalised, logits))


def _filter_sorted(sorted_logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Top-k, then top-p, then min-p on logits sorted descending per row; returns masked logits."""
    width = sorted_logits.shape[1]
    ranks = torch.arange(width).unsqueeze(0)
    top_k = torch.tensor([r.params.top_k or width for r in rows]).unsqueeze(1)
    masked = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = masked.softmax(dim=-1)
    top_p = torch.tensor([r.params.top_p for r in rows]).unsqueeze(1)
    mass_before = probs.cumsum(dim=-1) - probs
    masked = masked.masked_fill(mass_before > top_p, float("-inf"))
    probs = masked.softmax(dim=-1)
    min_p = torch.tensor([r.params.min_p for r in rows]).unsqueeze(1)
    return masked.masked_fill(probs < min_p * probs[:, :1], float("-inf"))


def _draw(probs: torch.Tensor, rows: list[SamplingRow], default: torch.Generator) -> torch.Tensor:
    """One categorical draw per row as argmax(p / E), E ~ Exp(1) drawn from the row's own generator
    (seeded requests stay reproducible whatever they are batched with); one batched argmax.
    Unlike an inverse-CDF search this is not thrown by float noise in the probabilities."""
    width = probs.shape[1]
    noise = torch.stack([torch.empty(width).exponential_(generator=row.generator or default) for row in rows])
    return (probs / noise).argmax(dim=-1)


def sample(
    logits: torch.Tensor,  # [B, C] float
    cand_ids: torch.Tensor | None,  # [B, C] vocab id of each column, or None for the full vocab
    rows: list[SamplingRow],
    default_generator: torch.Generator,
) -> list[int]:
    logits = logits.float().clone()
    apply_repetition_penalty(logits, cand_ids, rows)
    picked = logits.argmax(dim=-1)  # [B]
    random_rows = [b for b, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        sub_rows = [rows[b] for b in random_rows]
        temps = torch.tensor([r.params.temperature for r in sub_rows]).unsqueeze(1)
        sorted_logits, order = (logits[random_rows] / temps).sort(dim=-1, descending=True)
        probs = _filter_sorted(sorted_logits, sub_rows).softmax(dim=-1)
        choice = _draw(probs, sub_rows, default_generator)
        picked[random_rows] = order.gather(1, choice.unsqueeze(1)).squeeze(1)
    if cand_ids is not None:
        picked = cand_ids.gather(1, picked.unsqueeze(1)).squeeze(1)
    return picked.tolist()

"""The sampler on the host CPU, in numpy: same semantics as `llm_stage.sampler`'s torch path.

On CPU a step's sampling is a few dozen small ops on [rows, ~4k] arrays, so per-op overhead
dominates, and torch's is several times numpy's. Here each row's filters (top-k, top-p over
the top-k mass, min-p) run on its weights exp(logit - max) sorted by value only, which gives
the smallest kept weight; the draw is then an exponential race over the kept weights (argmax
of weight / E, E = -log U, U from the row's key and the column: `llm_stage.draws`, as the torch
path draws), so seeded rows reproduce whatever they are batched with, and float noise in the logits (a stream
resumed by re-prefill on another replica computes its KV in another order) moves a draw only
when two columns' races tie to that noise: about one draw in a million, where an inverse-CDF
search over thousands of near-equal weights flipped about one draw in a thousand (issue 23).
The same uniforms as the torch path, so the same seed draws the same tokens on an accelerator but
where float noise ties two columns' races. A weight that rounds to the smallest kept one is kept,
as the torch path keeps ties of the smallest kept logit.
`llm_stage.sampler.sample` sends CPU logits here.
"""

from __future__ import annotations

import numpy as np
import torch

from llm_stage.draws import column_uniforms_np


def history_pairs(rows: list) -> tuple[np.ndarray, np.ndarray] | None:
    """(row index, id) of every history id of the rows with a repetition penalty, as two int64
    arrays (`rows`: `llm_stage.sampler.SamplingRow`s); None when no row is penalised. numpy
    builds these from Python ints ~7x faster than torch.tensor (1,280 ids: 42 vs 298 us)."""
    penalised = [b for b, row in enumerate(rows) if row.params.repetition_penalty != 1.0 and len(row.history)]
    if not penalised:
        return None
    lengths = [len(rows[b].history) for b in penalised]
    tokens = np.concatenate([np.asarray(rows[b].history, dtype=np.int64) for b in penalised])
    return np.repeat(np.array(penalised, dtype=np.int64), lengths), tokens


def penalize_repeats(logits: np.ndarray, cand_ids: np.ndarray | None, rows: list) -> None:
    """In place: logit / p when positive, logit * p when negative, for ids in the row's history;
    columns are vocabulary ids, or `cand_ids`' ids."""
    pairs = history_pairs(rows)
    if pairs is None:
        return
    row_of, tokens = pairs
    hits = np.flatnonzero(_seen_columns(logits.shape, cand_ids, row_of, tokens))
    hit_rows, hit_cols = np.divmod(hits, logits.shape[1])
    penalty = np.array([r.params.repetition_penalty for r in rows], dtype=logits.dtype)[hit_rows]
    values = logits[hit_rows, hit_cols]
    logits[hit_rows, hit_cols] = np.where(values > 0, values / penalty, values * penalty)


def _seen_columns(shape: tuple[int, int], cand_ids: np.ndarray | None, row_of: np.ndarray, tokens: np.ndarray):
    """[B, C] bool: which columns hold an id of the row's history."""
    if cand_ids is None:
        keep = tokens < shape[1]
        seen = np.zeros(shape, dtype=bool)
        seen[row_of[keep], tokens[keep]] = True
        return seen
    low = int(tokens.min())
    span = int(tokens.max()) - low + 1  # ids outside [low, low + span) are in no history
    seen = np.zeros((shape[0], span + 1), dtype=bool)  # column `span`: never seen
    seen[row_of, tokens - low] = True
    offsets = np.subtract(cand_ids, low, dtype=np.int64).view(np.uint64)  # padding (-1) and ids below
    np.minimum(offsets, span, out=offsets)  # `low` wrap to huge values, then stop at `span`
    offsets += np.arange(shape[0], dtype=np.uint64)[:, None] * np.uint64(span + 1)  # into the flat mask
    return np.take(seen.reshape(-1), offsets.view(np.int64))


def _cumsum(values: np.ndarray) -> np.ndarray:
    """Row-wise cumulative sum; torch's float32 kernel is ~3x numpy's on this path's row widths."""
    return torch.from_numpy(values).cumsum(dim=1).numpy()


def smallest_kept_weight(weights: np.ndarray, rows: list) -> np.ndarray:
    """[B, 1]: each row's smallest weight (exp(logit - row max), so the best is 1) kept by top-k,
    then top-p over the top-k mass, then min-p relative to the best; ties of it are kept too.

    On the ascending sort the kept weights are a suffix: index i is kept by top-p when the mass
    above it, total - cumulative[i], is within top_p of the top-k mass."""
    width = weights.shape[1]
    ascending = np.sort(weights, axis=1)
    cumulative = _cumsum(ascending)
    first = []
    for b, params in enumerate(r.params for r in rows):
        below_k = width - min(params.top_k or width, width)  # ascending index where the top-k begins
        total = float(cumulative[b, -1])
        top_k_mass = total - (float(cumulative[b, below_k - 1]) if below_k else 0.0)
        by_p = int(np.searchsorted(cumulative[b], total - params.top_p * top_k_mass, side="left"))
        by_min_p = int(np.searchsorted(ascending[b], params.min_p, side="left")) if params.min_p else 0
        first.append(min(max(below_k, by_p, by_min_p), width - 1))
    return ascending[np.arange(len(rows)), first][:, None]


def draw(values: np.ndarray, temperature: np.ndarray, rows: list) -> np.ndarray:
    """One column per row from the filtered distribution of logits / temperature ([B, 1]): an
    exponential race over the kept weights (no sort with indices), the uniforms hashed from the
    row's key and each kept column only (`llm_stage.draws`)."""
    weights = np.exp((values - values.max(axis=1, keepdims=True)) / temperature)
    kept = weights >= smallest_kept_weight(weights, rows)
    picked = np.empty(len(rows), dtype=np.int64)
    for b in range(len(rows)):
        columns = np.flatnonzero(kept[b])
        race = weights[b, columns] / -np.log(column_uniforms_np(rows[b].key, columns, values.shape[1]))
        picked[b] = columns[int(np.argmax(race))]
    return picked


def sample_on_host(logits: torch.Tensor, cand_ids: torch.Tensor | None, rows: list):
    """Vocabulary id per row: greedy rows take the argmax, the rest a filtered draw."""
    values = logits.float().numpy().copy()  # the penalty writes in place
    cands = None if cand_ids is None else cand_ids.numpy()
    penalize_repeats(values, cands, rows)
    greedy = [r.params.is_greedy for r in rows]
    picked = np.empty(len(rows), dtype=np.int64)
    if any(greedy):
        picked[greedy] = values[greedy].argmax(axis=1)
    if not all(greedy):
        drawn = [b for b, g in enumerate(greedy) if not g]
        temperature = np.array([[rows[b].params.temperature] for b in drawn], dtype=np.float32)
        subset = values if len(drawn) == len(rows) else values[drawn]
        picked[drawn] = draw(subset, temperature, [rows[b] for b in drawn])
    if cands is not None:
        picked = cands[np.arange(len(rows)), picked]
    return picked.tolist()

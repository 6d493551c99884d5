"""Classifier-free guidance: merge a guided row's logits with its unconditional twin's.

The engine calls `merge_guidance` on a step's logits (twins on the row after their guided
request) before the adapter's sampling rules; it returns only the visible rows. Formulas:
Dia `cond + g * (cond - uncond)` (optionally top-k of the guided logits over cond);
Chatterbox `cond + g * (cond - uncond)`; MusicGen / Bagpiper `uncond + g * (cond - uncond)`.
"""

from __future__ import annotations

import enum

import torch

from llm_stage.request import Request


class GuidanceFormula(enum.Enum):
    DIA = "dia"  # cond + g * (cond - uncond); top-k of that, applied to cond
    LINEAR = "linear"  # uncond + g * (cond - uncond)  (MusicGen, Bagpiper / OpusLM)
    COND_DELTA = "cond_delta"  # cond + g * (cond - uncond), then the sampler's own filters (Chatterbox T3)


def _scales(rows: list[Request], like: torch.Tensor) -> torch.Tensor:
    values = [r.sampling.guidance_scale or 0.0 for r in rows]
    return torch.tensor(values, dtype=like.dtype, device=like.device).view(-1, *([1] * (like.dim() - 1)))


def _dia_top_k(cond: torch.Tensor, guided: torch.Tensor, rows: list[Request]) -> torch.Tensor:
    """Per row with top_k > 0: cond logits kept only where `guided` is in its top-k; rows with top_k 0 keep
    `guided`. One batched top-k at the largest k, each row keeping its first k ranks: a fixed number of
    launches whatever the batch (a loop over rows cost 4 launches per guided row on a GPU)."""
    ks = [row.sampling.top_k or 0 for row in rows]
    k_max = min(max(ks), guided.shape[-1])
    if k_max == 0:
        return guided.clone()
    shape = (-1, *([1] * (guided.dim() - 1)))
    k_row = torch.tensor(ks, device=guided.device).clamp(max=k_max).view(shape)  # [G, 1.., 1]
    top = guided.topk(k_max, dim=-1).indices  # [G, ..., k_max], largest first
    in_top_k = torch.arange(k_max, device=guided.device) < k_row  # [G, ..., k_max]
    kept = cond.gather(-1, top).masked_fill(~in_top_k, float("-inf"))
    masked = torch.full_like(cond, float("-inf")).scatter(-1, top, kept)
    return torch.where(k_row > 0, masked, guided)


def guide(cond: torch.Tensor, uncond: torch.Tensor, rows: list[Request], formula: GuidanceFormula) -> torch.Tensor:
    """cond / uncond [G, ...] float logits of G guided rows -> merged [G, ...]."""
    scale = _scales(rows, cond)
    if formula is GuidanceFormula.LINEAR:
        return uncond + scale * (cond - uncond)
    if formula is GuidanceFormula.COND_DELTA:
        return cond + scale * (cond - uncond)
    return _dia_top_k(cond, cond + scale * (cond - uncond), rows)


def merge_guidance(
    logits: torch.Tensor,  # [N, ...] every sampling row, twins right after their guided row
    cand_ids: torch.Tensor | None,
    rows: list[Request],
    formula: GuidanceFormula | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return logits (and candidate ids) of the visible rows, guided rows merged with their twins."""
    guided = [i for i, r in enumerate(rows) if r.twin is not None]
    visible = [i for i, r in enumerate(rows) if not r.is_twin]
    if not guided:
        return logits, cand_ids
    if formula is None:
        raise ValueError("a CFG row reached an adapter without a guidance formula")
    logits = logits.float().clone()
    twins = [i + 1 for i in guided]
    if any(not rows[j].is_twin or rows[i].twin is not rows[j] for i, j in zip(guided, twins, strict=True)):
        raise RuntimeError("CFG twin is not on the row after its guided request")
    logits[guided] = guide(logits[guided], logits[twins], [rows[i] for i in guided], formula)
    return logits[visible], None if cand_ids is None else cand_ids[visible]

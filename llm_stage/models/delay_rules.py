"""Sampling rules of delay-pattern models, shared by the parallel-heads and Dia adapters.

Per step and codebook: BOS until the codebook's first frame; once codebook 0 has sampled EOS
at step e, codebook k is forced to EOS at e + (delays[k] - delays[0]) and to PAD after it; a
request that reaches its length limit starts that cascade itself so its last frames complete.
"""

from __future__ import annotations

import torch

from llm_stage.delay_pattern import DelayPattern
from llm_stage.request import Request


def check_stream0_leads(pattern: DelayPattern) -> None:
    if pattern.delays[0] != min(pattern.delays):
        raise ValueError(f"codebook 0 ends the utterance, so it needs the smallest delay: {pattern.delays}")


def eos_step(req: Request, eos_id: int, lookback: int) -> int | None:
    """The step at which codebook 0 sampled EOS, searched over the last `lookback` steps."""
    outputs = req.output_ids
    for step in range(max(0, len(outputs) - lookback), len(outputs)):
        if outputs[step][0] == eos_id:  # type: ignore[index]
            return step
    return None


def forced_ids(pattern: DelayPattern, step: int, end_step: int | None, eos_id: int) -> list[int | None]:
    """Per codebook: the id this step must take, or None when it is sampled."""
    forced: list[int | None] = []
    for delay in pattern.delays:
        if step < delay:
            forced.append(pattern.bos_id)
        elif end_step is None:
            forced.append(None)
        else:
            lag = delay - pattern.delays[0]
            forced.append(None if step < end_step + lag else eos_id if step == end_step + lag else pattern.pad_id)
    return forced


def apply_forced(logits: torch.Tensor, forced: list[list[int | None]]) -> torch.Tensor:
    """logits [B, K, V]: a forced (row, codebook) keeps only its id (logit 0, others -inf)."""
    triples = [(b, k, i) for b, row in enumerate(forced) for k, i in enumerate(row) if i is not None]
    if not triples:
        return logits
    rows, books, ids = zip(*triples, strict=True)
    rows_t, books_t, ids_t = (torch.tensor(v, device=logits.device) for v in (rows, books, ids))
    logits[rows_t, books_t] = float("-inf")
    logits[rows_t, books_t, ids_t] = 0.0
    return logits

"""Model runner: turns a StepPlan into tensors, runs the backbone on the slot KV cache and
returns the hidden state of every row that samples this step. Called by `LLMEngine.step`.

Decode rows run as one [B, 1] forward; prompt chunks as one padded [P, T] forward. Positions
become [B, T, W] id lanes that the adapter embeds (W = 1 for flat token streams).
"""

from __future__ import annotations

import torch

from llm_stage.kv_cache import SlotKVCache
from llm_stage.models.base import LMAdapter
from llm_stage.models.llama import BatchInputs
from llm_stage.scheduler import PrefillWork, StepPlan


class ModelRunner:
    def __init__(self, adapter: LMAdapter, num_slots: int, max_seq_len: int) -> None:
        self.adapter = adapter
        self.backbone = backbone = adapter.backbone
        weight = backbone.lm_head_weight
        self.device = weight.device
        self.cache = SlotKVCache(
            backbone.num_layers, num_slots, backbone.num_kv_heads, max_seq_len, backbone.head_dim,
            weight.dtype, weight.device,
        )  # fmt: skip

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Hidden states [N, H] for `plan.sampling_rows`, in that order."""
        parts = []
        if plan.decodes:
            parts.append(self._forward(self._decode_inputs(plan)))
        finishing = [i for i, w in enumerate(plan.prefills) if w.completes_prompt]
        if plan.prefills:
            hidden = self._forward(self._prefill_inputs(plan.prefills))
            parts.append(hidden[finishing])
        return torch.cat(parts) if parts else torch.empty(0, self.backbone.hidden_size)

    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        return self.backbone.forward(batch, self.cache, embeds=self.adapter.embed(batch.input_ids))

    def _decode_inputs(self, plan: StepPlan) -> BatchInputs:
        lanes = self.adapter.token_lanes
        ids = [[lanes(r.token_at(r.num_cached))] for r in plan.decodes]
        positions = [[r.num_cached] for r in plan.decodes]
        slots = [r.slot for r in plan.decodes]
        return self._to_batch(ids, positions, slots, [[s] for s in slots], [0] * len(slots))

    def _prefill_inputs(self, works: list[PrefillWork]) -> BatchInputs:
        width = max(w.num_tokens for w in works)
        last = self.cache.max_seq_len - 1
        ids, positions, write_slots = [], [], []
        lanes, pad_lanes = self.adapter.token_lanes, self.adapter.token_lanes(self.adapter.pad_token)
        for w in works:
            pad = width - w.num_tokens
            ids.append([lanes(w.req.token_at(i)) for i in range(w.start, w.start + w.num_tokens)] + [pad_lanes] * pad)
            positions.append([min(w.start + i, last) for i in range(width)])
            write_slots.append([w.req.slot] * w.num_tokens + [self.cache.scratch_slot] * pad)
        last_index = [w.num_tokens - 1 for w in works]
        return self._to_batch(ids, positions, [w.req.slot for w in works], write_slots, last_index)

    def _to_batch(self, ids, positions, slots, write_slots, last_index) -> BatchInputs:
        def as_tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return BatchInputs(
            as_tensor(ids), as_tensor(positions), as_tensor(slots), as_tensor(write_slots), as_tensor(last_index)
        )

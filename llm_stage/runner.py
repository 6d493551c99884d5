"""Model runner: turns a StepPlan into tensors, runs the backbone on the slot KV cache and
returns the hidden state of every row that samples this step. Called by `LLMEngine.step`.

Decode rows run as one [B, 1] forward. Prompt chunks fold into it on CUDA (`fold_prefill`): each
prompt token becomes one more row that attends to its own prefix, as a decode row does, so a
step that starts streams is one replay of the decode graph of its size and costs the running
streams a few rows, not an eager forward; otherwise (CPU, or too many prompt tokens for the
largest graph) they run as one padded [P, T] forward. Positions
become [B, T, W] id lanes that the adapter embeds (W = 1 for flat token streams). `prepare`
(host: reads request state, builds tensors) and `forward` (tensors only) are separate so the
engine can run the forward on another thread while it plans the next step. Each forward's
inputs go to the device in one non-blocking copy (`core.transfer`), so preparing a step never
waits for the GPU. Decode forwards replay CUDA graphs when `graphs` has one for the batch size,
padded on the host to the next captured size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.config import CacheConfig
from core.graphs import graphs_available
from core.transfer import to_device
from llm_stage.decode_graphs import DecodeGraphs, PaddingRow
from llm_stage.kv_blocks import BlockAllocator
from llm_stage.kv_cache import PagedKVCache, make_cache
from llm_stage.models.base import LMAdapter
from llm_stage.models.llama import BatchInputs
from llm_stage.request import Request
from llm_stage.scheduler import PrefillWork, StepPlan

logger = logging.getLogger(__name__)


FOLD_MAX_PROMPT_TOKENS = 512  # without graphs: prompt tokens folded into a decode forward at most


def folds_prefill(adapter: LMAdapter, device: torch.device) -> bool:
    """Whether prompt chunks run as rows of the decode forward: on CUDA (on CPU the padded prompt forward
    is cheaper than attending over each token's prefix row by row), for a backbone wired for the decode
    graphs' one-position forward and a family whose prompt embeddings are not chosen on the host."""
    return adapter.backbone.supports_decode_graphs and adapter.folds_prompts and device.type == "cuda"


@dataclass(frozen=True)
class PreparedStep:
    """One step's input tensors: read from request state on the host, safe to run on another thread."""

    decode: BatchInputs | None  # one position per row (decodes, then folded prompt tokens), graph-padded
    prefill: BatchInputs | None  # prompt chunks not folded: one padded forward
    finishing: torch.Tensor | None  # rows of `prefill` whose prompt completes this step; None = all
    num_decodes: int = 0  # rows of `decode` that sample when nothing is folded: the first ones
    folded_rows: torch.Tensor | None = None  # folded: the rows of `decode` that sample, in plan order


class ModelRunner:
    def __init__(
        self,
        adapter: LMAdapter,
        cache: CacheConfig,
        graph_batch_sizes: Sequence[int] = (),
        blocks: BlockAllocator | None = None,
    ) -> None:
        self.adapter = adapter
        self.backbone = backbone = adapter.backbone
        weight = backbone.lm_head_weight
        self.device = weight.device
        self.cache = make_cache(
            cache, backbone.num_layers, backbone.num_kv_heads, backbone.head_dim, weight.dtype, weight.device
        )
        self.blocks = blocks  # the paged layout: the scheduler's block accounting, mirrored into the table
        self.graphs = self._decode_graphs(graph_batch_sizes) if graph_batch_sizes else None
        self.fold_prefill = folds_prefill(adapter, self.device)

    def _decode_graphs(self, batch_sizes: Sequence[int]) -> DecodeGraphs | None:
        """Capture decode graphs when the device and the backbone allow; otherwise say so and run eagerly."""
        if not graphs_available(self.device):
            logger.warning("CUDA graphs requested on %s: decode runs eagerly", self.device)
            return None
        if not self.backbone.supports_decode_graphs:
            logger.warning("CUDA graphs are not wired for %s: decode runs eagerly", type(self.backbone).__name__)
            return None
        graphs = DecodeGraphs(self._decode_forward, batch_sizes, self.padding_row, self.device)
        logger.info("captured %d decode CUDA graphs of %s", graphs.capture_all(), graphs.batch_sizes)
        return graphs

    @property
    def padding_row(self) -> PaddingRow:
        return PaddingRow(self.adapter.token_lanes(self.adapter.pad_token), self.cache.scratch_slot)

    def sync_blocks(self) -> None:
        """The block-table rows the scheduler changed (admissions, growth, releases) into the cache:
        its host mirror now, the device table with the next forward's input copy (`_to_batch`)."""
        if self.blocks is not None:
            for slot, blocks in self.blocks.take_changed():
                self.cache.assign(slot, blocks)

    def prepare(self, plan: StepPlan) -> PreparedStep:
        self.sync_blocks()
        if plan.prefills and self._folds(plan):
            batch, sampling = self._one_position_rows(plan.decodes, plan.prefills)
            return PreparedStep(batch, None, None, len(plan.decodes), self._indices(sampling))
        finishing = [i for i, w in enumerate(plan.prefills) if w.completes_prompt]
        return PreparedStep(
            self._one_position_rows(plan.decodes, [])[0] if plan.decodes else None,
            self._prefill_inputs(plan.prefills) if plan.prefills else None,
            None if len(finishing) == len(plan.prefills) else self._indices(finishing),
            len(plan.decodes),
        )

    def _indices(self, rows: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(rows, dtype=torch.long), self.device)

    def _folds(self, plan: StepPlan) -> bool:
        """Whether this step's prompt tokens join the decode forward (one graph replay when one fits)."""
        if not self.fold_prefill:
            return False
        prompt_tokens = sum(w.num_tokens for w in plan.prefills)
        if self.graphs is not None:
            return self.graphs.size_for(len(plan.decodes) + prompt_tokens) is not None
        return prompt_tokens <= FOLD_MAX_PROMPT_TOKENS

    @torch.inference_mode()
    def forward(self, step: PreparedStep) -> torch.Tensor:
        """Hidden states [N, H] for the plan's `sampling_rows`, in that order."""
        parts = []
        if step.decode is not None:
            replayed = self.graphs.run(step.decode) if self.graphs is not None else None
            hidden = replayed if replayed is not None else self._decode_forward(step.decode)
            rows = step.folded_rows
            parts.append(hidden[: step.num_decodes] if rows is None else hidden.index_select(0, rows))
        if step.prefill is not None:
            hidden = self._forward(step.prefill)
            parts.append(hidden if step.finishing is None else hidden.index_select(0, step.finishing))
        return torch.cat(parts) if parts else torch.empty(0, self.backbone.hidden_size)

    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        return self.backbone.forward(batch, self.cache, embeds=self.adapter.embed(batch.input_ids))

    def _decode_forward(self, batch: BatchInputs) -> torch.Tensor:
        """The decode forward (one position a row: sampled tokens, and folded prompt positions), replayed
        as a CUDA graph where captured."""
        return self.backbone.forward(batch, self.cache, embeds=self.adapter.decode_embed(batch.input_ids))

    def _one_position_rows(self, decodes: list[Request], prompts: list[PrefillWork]) -> tuple[BatchInputs, list[int]]:
        """One position per row: each decode row's next, then every prompt token of `prompts`; with
        graphs, padding rows up to the captured size. Also the rows that sample: the decodes and
        each completed prompt's last token, in plan order."""
        lanes_at = self.adapter.lanes_at
        ids = [[lanes_at(r, r.num_cached)] for r in decodes]
        positions = [[r.num_cached] for r in decodes]
        slots = [r.slot for r in decodes]
        sampling = list(range(len(decodes)))
        for work in prompts:
            for index in range(work.start, work.start + work.num_tokens):
                ids.append([lanes_at(work.req, index)])
                positions.append([index])
                slots.append(work.req.slot)
            if work.completes_prompt:
                sampling.append(len(slots) - 1)
        size = self.graphs.size_for(len(slots)) if self.graphs is not None else None
        if size is not None:
            padding = self.padding_row
            extra = size - len(slots)
            ids += [[padding.lanes]] * extra
            positions += [[0]] * extra
            slots += [padding.scratch_slot] * extra
        return self._to_batch(ids, positions, slots, [[s] for s in slots], [0] * len(slots)), sampling

    def _prefill_inputs(self, works: list[PrefillWork]) -> BatchInputs:
        width = max(w.num_tokens for w in works)
        last = self.cache.max_seq_len - 1
        ids, positions, write_slots = [], [], []
        lanes_at, pad_lanes = self.adapter.lanes_at, self.adapter.token_lanes(self.adapter.pad_token)
        for w in works:
            pad = width - w.num_tokens
            ids.append([lanes_at(w.req, i) for i in range(w.start, w.start + w.num_tokens)] + [pad_lanes] * pad)
            positions.append([min(w.start + i, last) for i in range(width)])
            write_slots.append([w.req.slot] * w.num_tokens + [self.cache.scratch_slot] * pad)
        last_index = [w.num_tokens - 1 for w in works]
        attend_len = max(min(w.start + w.num_tokens, last + 1) for w in works)
        return self._to_batch(ids, positions, [w.req.slot for w in works], write_slots, last_index, attend_len)

    def _to_batch(self, ids, positions, slots, write_slots, last_index, attend_len: int | None = None) -> BatchInputs:
        """The five index tensors built on the host and sent to the device as one non-blocking copy,
        with the block-table rows changed since the last copy (paged layout on an accelerator), which
        land in the table before this forward's kernels read it (same stream)."""
        host = [torch.tensor(values, dtype=torch.long) for values in (ids, positions, slots, write_slots, last_index)]
        table_rows = self.cache.take_pending() if isinstance(self.cache, PagedKVCache) else None
        if table_rows is not None:
            host += [t.long() for t in table_rows]
        on_device = to_device(torch.cat([t.flatten() for t in host]), self.device)
        parts = on_device.split([t.numel() for t in host])
        fields = [part.view(t.shape) for part, t in zip(parts, host, strict=True)]
        if table_rows is not None:
            table_slots, rows = fields.pop(5), fields.pop(5)
            self.cache.table.index_copy_(0, table_slots, rows.to(self.cache.table.dtype))
        return BatchInputs(*fields, attend_len=attend_len)

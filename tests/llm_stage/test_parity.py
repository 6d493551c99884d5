"""Greedy token-for-token parity of the batched engine with transformers' generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from core.messages import SamplingParams
from llm_stage.models.orpheus import allowed_token_ids
from llm_stage.request import Request
from tests.factories import STEP_MODES, orpheus_adapter, orpheus_engine, text_engine, tiny_text_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def hf_greedy(model, prompt: list[int], max_new: int, processors=None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
        logits_processor=processors, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("async_steps", "kv_layout"), STEP_MODES, indirect=["kv_layout"])
def test_greedy_parity_with_staggered_joins(async_steps, kv_layout):
    model = tiny_text_llama()
    engine = text_engine(model, num_slots=6, prefill_token_budget=16, async_steps=async_steps)
    prompts = {f"r{i}": [1] + [3 + (7 * i + j) % 400 for j in range(5 + 9 * i)] for i in range(5)}
    join_at_step = {"r0": 0, "r1": 0, "r2": 3, "r3": 7, "r4": 12}
    got: dict[str, list[int]] = {k: [] for k in prompts}
    step = 0
    while step < 200 and (engine.has_work or any(s >= step for s in join_at_step.values())):
        for req_id, at in join_at_step.items():
            if at == step:
                engine.add_prompt(req_id, prompts[req_id], GREEDY)
        for out in engine.step():
            got[out.req_id].extend(out.new_token_ids)
        step += 1
    for req_id, prompt in prompts.items():
        assert got[req_id] == hf_greedy(model, prompt, GREEDY.max_tokens), req_id


class OrpheusSlotMask(LogitsProcessor):
    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len

    def __call__(self, input_ids, scores):
        allowed = allowed_token_ids(input_ids.shape[1] - self.prompt_len)
        masked = torch.full_like(scores, float("-inf"))
        masked[:, allowed] = scores[:, allowed]
        return masked


@pytest.mark.parametrize(("async_steps", "kv_layout"), STEP_MODES, indirect=["kv_layout"])
def test_orpheus_greedy_parity_with_frame_slot_mask(async_steps, kv_layout):
    engine = orpheus_engine(num_slots=4, async_steps=async_steps)
    model_prompts = {f"o{i}": engine.adapter.format_prompt("hello world " * (i + 1), "tara") for i in range(4)}
    params = SamplingParams(temperature=0.0, max_tokens=21)
    for req_id, prompt in model_prompts.items():
        engine.add_prompt(req_id, prompt, params)
    got = engine.run_to_completion()
    model = orpheus_adapter().backbone.hf_model  # the very weights the engine runs
    for req_id, prompt in model_prompts.items():
        want = hf_greedy(model, prompt, 21, LogitsProcessorList([OrpheusSlotMask(len(prompt))]))
        assert got[req_id] == want, req_id


def test_orpheus_slot_logits_match_lm_head_columns_for_any_grouping():
    """Rows on one frame slot in groups of 1-5 (both products of `_slot_logits`) give lm_head's own logits."""
    adapter = orpheus_adapter()
    weight = adapter.backbone.lm_head_weight
    generated = [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 7]  # slots 0,1,1,2,2,2,3x4,4x5, 0 (boundary)
    reqs = [Request(f"r{i}", [1], SamplingParams(), arrival_s=0.0) for i in range(len(generated))]
    for req, n in zip(reqs, generated, strict=True):
        req.output_ids = [0] * n
    hidden = torch.randn(len(reqs), weight.shape[1], generator=torch.Generator().manual_seed(0))
    logits, cand = adapter.logits(hidden, reqs)
    for b, n in enumerate(generated):
        allowed = allowed_token_ids(n)
        want = hidden[b] @ weight[allowed].T
        assert cand[b, : len(allowed)].tolist() == allowed
        torch.testing.assert_close(logits[b, : len(allowed)], want, rtol=1e-5, atol=1e-5)
        assert len(allowed) == logits.shape[1] or logits[b, -1] == float("-inf")  # end-of-speech only at a boundary


@pytest.mark.parametrize("generated", [3, 7])
def test_orpheus_slot_logits_of_aligned_rows(generated):
    """Rows all on one frame slot (the aligned case, one plain copy) give lm_head's own logits."""
    adapter = orpheus_adapter()
    weight = adapter.backbone.lm_head_weight
    reqs = [Request(f"r{i}", [1], SamplingParams(), arrival_s=0.0) for i in range(4)]
    for req in reqs:
        req.output_ids = [0] * generated
    hidden = torch.randn(len(reqs), weight.shape[1], generator=torch.Generator().manual_seed(1))
    logits, _ = adapter.logits(hidden, reqs)
    allowed = allowed_token_ids(generated)
    torch.testing.assert_close(logits[:, : len(allowed)], hidden @ weight[allowed].T, rtol=1e-5, atol=1e-5)

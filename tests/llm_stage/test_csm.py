"""CSM: greedy parity of backbone-in-engine + batched depth decoder with transformers' own CSM
generation, 4 concurrent requests with staggered joins."""

from __future__ import annotations

import functools

import pytest
import torch

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from llm_stage.engine import LLMEngine
from llm_stage.models.csm import CsmAdapter
from tests.factories import STEP_MODES


@functools.cache
def adapter() -> CsmAdapter:
    ad = CsmAdapter.build(ModelConfig(name="csm-tiny", seed=5))
    with torch.no_grad():  # wider than HF's init so greedy picks are not near-ties
        for p in ad.model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return ad


def hf_frames(prompt: list[tuple], max_new: int) -> list[list[int]]:
    ids = torch.tensor([[p[-1] for p in prompt]])
    with torch.no_grad():
        out = adapter().model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
            depth_decoder_do_sample=False,
        )  # fmt: skip
    return out[0].tolist()


@pytest.mark.parametrize(("async_steps", "kv_layout"), STEP_MODES, indirect=["kv_layout"])
def test_greedy_parity_with_transformers_csm_generate(async_steps, kv_layout):
    ad = adapter()
    engine = LLMEngine(
        ad,
        CacheConfig(num_slots=4, max_seq_len=128),
        SchedulerConfig(max_batch_size=4, prefill_token_budget=12, async_steps=async_steps),
    )
    texts = {"a": "hi", "b": "a somewhat longer line", "c": "third", "d": "the fourth request joins late"}
    join_at = {"a": 0, "b": 0, "c": 2, "d": 5}
    prompts = {k: ad.format_prompt(t, "1") for k, t in texts.items()}
    frames: dict[str, list] = {k: [] for k in texts}
    for step in range(200):
        for req_id, at in join_at.items():
            if at == step:
                engine.add_prompt(req_id, prompts[req_id], ad.default_sampling.model_copy(update={
                    "temperature": 0.0, "max_tokens": 12,
                }))  # fmt: skip
        for out in engine.step():
            frames[out.req_id].extend(out.new_frames)
        if step > max(join_at.values()) and not engine.has_work:
            break
    for req_id, prompt in prompts.items():
        want = hf_frames(prompt, 12)
        assert frames[req_id] == want[: len(frames[req_id])], req_id
        assert len(frames[req_id]) == 12 or all(c == 0 for c in want[len(frames[req_id])][:-1])


def test_stop_frame_is_all_eos_on_first_k_minus_1_codebooks():
    ad = adapter()
    assert ad.is_stop(None, (0,) * 7 + (5,))  # type: ignore[arg-type]
    assert not ad.is_stop(None, (0,) * 6 + (1, 0))  # type: ignore[arg-type]

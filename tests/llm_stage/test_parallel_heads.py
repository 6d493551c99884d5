"""Parallel-heads (Bagpiper style) adapter: greedy parity with a plain HF-forward reference loop
(4 concurrent requests, CFG on for two of them), delay-pattern rules, loader round trip."""

from __future__ import annotations

import functools

import pytest
import torch

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from core.messages import SamplingParams
from llm_stage.engine import LLMEngine
from llm_stage.models.parallel_heads import ParallelHeadsAdapter, save_parallel_heads
from llm_stage.request import Request
from tests.factories import STEP_MODES


@functools.cache
def adapter() -> ParallelHeadsAdapter:
    return ParallelHeadsAdapter.build(ModelConfig(name="parallel-heads-tiny", seed=3))


def engine(num_slots: int = 8, budget: int = 16, async_steps: bool = False) -> LLMEngine:
    return LLMEngine(
        adapter(), CacheConfig(num_slots=num_slots, max_seq_len=256),
        SchedulerConfig(max_batch_size=num_slots, prefill_token_budget=budget, async_steps=async_steps),
    )  # fmt: skip


@torch.inference_mode()
def last_logits(ad: ParallelHeadsAdapter, positions: list) -> torch.Tensor:
    """transformers' own Qwen3 forward over the whole sequence (no cache) -> head logits [K, V]."""
    ids = torch.tensor([[ad.token_lanes(p) for p in positions]])
    hidden = ad.backbone.model(inputs_embeds=ad.embed(ids)).last_hidden_state[:, -1]
    return ad.heads.logits(hidden)[0].float()


def reference_greedy(ad: ParallelHeadsAdapter, text: str, max_tokens: int, scale: float | None) -> list[tuple]:
    layout, delays = ad.layout, ad.layout.delays
    cond, uncond = ad.format_prompt(text, None), ad.unconditional_prompt(text, None)
    steps: list[tuple] = []
    end = None
    for s in range(max_tokens):
        logits = last_logits(ad, cond + steps).clone()
        if scale is not None:
            base = last_logits(ad, uncond + steps).clone()
            logits = base + scale * (logits - base)
        logits[1:, layout.eos_id :] = float("-inf")
        logits[0, layout.eos_id + 1 :] = float("-inf")
        picks = logits.argmax(-1).tolist()
        if end is None and (picks[0] == layout.eos_id or s == max_tokens - max(delays) - 1):
            end = s
        for k, d in enumerate(delays):
            if s < d:
                picks[k] = layout.bos_id
            elif end is not None and s >= end + d:
                picks[k] = layout.eos_id if s == end + d else layout.pad_id
        if end is not None and s == end + max(delays):
            break
        steps.append(tuple(picks))
    return steps


@pytest.mark.parametrize(("async_steps", "kv_layout"), STEP_MODES, indirect=["kv_layout"])
def test_greedy_parity_with_cfg_pairs_in_a_shared_batch(async_steps, kv_layout):
    eng = engine(async_steps=async_steps)
    cases = {
        "plain-short": ("hi", None, 18),
        "cfg-long": ("a longer prompt for guidance", 3.0, 22),
        "plain-long": ("another fairly long prompt here", None, 20),
        "cfg-short": ("yo", 1.5, 16),
    }
    for req_id, (text, scale, max_tokens) in cases.items():
        eng.add_request(req_id, text, None, {"temperature": 0.0, "max_tokens": max_tokens, "guidance_scale": scale})
    steps: dict[str, list] = {k: [] for k in cases}
    frames: dict[str, list] = {k: [] for k in cases}
    most_slots = 0
    while eng.has_work:
        outs = eng.step()
        most_slots = max(most_slots, eng.scheduler.slots.num_used)
        for out in outs:
            assert "#" not in out.req_id  # twins are never emitted
            if out.new_token_ids:
                steps[out.req_id].append(tuple(out.new_token_ids))
            frames[out.req_id].extend(out.new_frames)
    for req_id, (text, scale, max_tokens) in cases.items():
        want = reference_greedy(adapter(), text, max_tokens, scale)
        assert steps[req_id] == want, req_id
        assert frames[req_id] == adapter().pattern.deinterleave([list(s) for s in want])[: len(frames[req_id])]
        assert len(frames[req_id]) == max_tokens - 8  # the length limit starts the EOS cascade
    assert most_slots == 6  # each CFG twin holds its own KV slot
    assert eng.scheduler.slots.num_free == 8


def test_unit_guidance_scale_equals_unguided_greedy():
    """uncond + 1 * (cond - uncond) == cond: same tokens as without CFG."""
    outs = {}
    for scale in (None, 1.0):
        eng = engine()
        eng.add_request("r", "same text", None, {"temperature": 0.0, "max_tokens": 14, "guidance_scale": scale})
        outs[scale] = eng.run_to_completion()["r"]
    assert outs[None] == outs[1.0]


def fake_req(outputs: list[tuple], max_tokens: int = 100) -> Request:
    req = Request("r", [], SamplingParams(max_tokens=max_tokens))
    req.output_ids = list(outputs)
    return req


def test_eos_on_stream0_cascades_through_the_delays_then_stops():
    ad = adapter()
    lay = ad.layout
    free = tuple(range(8))
    eos_at = 10
    history = [free] * eos_at + [(lay.eos_id, *free[1:])]
    forced_next = ad.constrain(torch.zeros(1, 8, lay.stream_vocab), [fake_req(history)])[0]
    picks = forced_next.argmax(-1).tolist()
    assert picks[0] == lay.pad_id and picks[1] == lay.eos_id  # stream 1 (delay 1) ends one step later
    assert all(torch.isinf(forced_next[k, : lay.eos_id]).all() for k in (0, 1))
    assert not ad.is_stop(fake_req(history), free)
    tail = history + [free] * 6
    assert ad.is_stop(fake_req(tail), free)  # step eos_at + 7: the last stream's EOS
    assert not ad.is_stop(fake_req(tail[:-1]), free)


def test_checkpoint_round_trip(tmp_path):
    ad = adapter()
    save_parallel_heads(tmp_path, ad.backbone.hf_model, ad.heads, ad.layout)
    loaded = ParallelHeadsAdapter.build(ModelConfig(name="parallel-heads", checkpoint_dir=tmp_path, codec_dir=tmp_path))
    prompt = ad.format_prompt("round trip", None)
    torch.testing.assert_close(last_logits(loaded, prompt), last_logits(ad, prompt))
    assert loaded.layout == ad.layout

"""Factories shared by tests: tiny random-weight models and engines built in code."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from core.messages import SamplingParams
from llm_stage.engine import LLMEngine
from llm_stage.models.base import FrameBuilder, LMAdapter
from llm_stage.models.cosyvoice2 import CosyVoice2Adapter
from llm_stage.models.llama import LlamaBackbone
from llm_stage.models.orpheus import OrpheusAdapter
from llm_stage.request import Request
from llm_stage.scheduler import Scheduler


def tiny_text_llama(seed: int = 0, vocab: int = 512) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than HF's init so greedy paths are not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model


class _NoFrames(FrameBuilder):
    def push(self, token_id: int) -> list[list[int]]:
        return []


class TextLlamaAdapter(LMAdapter):
    """Plain next-token LM over full-vocab logits, for parity and scheduler tests."""

    family = "text-llama"

    def format_prompt(self, text: str, voice: str | None) -> list[int]:
        return [1, *(3 + (b % 500) for b in text.encode())]

    def new_frame_builder(self) -> FrameBuilder:
        return _NoFrames()


def text_engine(
    model: LlamaForCausalLM, num_slots: int = 8, max_seq_len: int = 256, cache: dict | None = None, **sched
) -> LLMEngine:
    adapter = TextLlamaAdapter(LlamaBackbone(model))
    adapter.eos_token_ids = frozenset()
    defaults = {"max_batch_size": num_slots, "prefill_token_budget": 64}
    return LLMEngine(
        adapter,
        CacheConfig(num_slots=num_slots, max_seq_len=max_seq_len, **(cache or {})),
        SchedulerConfig(**{**defaults, **sched}),
    )


_ORPHEUS: dict[int, OrpheusAdapter] = {}


def orpheus_adapter(seed: int = 0) -> OrpheusAdapter:
    """orpheus-tiny adapter, built once per seed per session (construction is the slow part)."""
    if seed not in _ORPHEUS:
        _ORPHEUS[seed] = OrpheusAdapter.build(ModelConfig(name="orpheus-tiny", seed=seed))
    return _ORPHEUS[seed]


PAGED_TEST_CACHE = {"layout": "paged", "block_size": 4}  # blocks of 4 tokens: a row spans many blocks
STEP_MODES = [  # (async_steps, kv_layout): the step modes of the families' greedy parity tests
    pytest.param(False, "slot", id="sync"),
    pytest.param(True, "slot", id="async"),
    pytest.param(False, "paged", id="paged"),
]


def orpheus_engine(
    num_slots: int = 8, max_seq_len: int = 1024, seed: int = 0, cache: dict | None = None, **sched
) -> LLMEngine:
    """`cache`: more CacheConfig fields (e.g. the paged layout)."""
    defaults = {"max_batch_size": num_slots, "prefill_token_budget": 128}
    return LLMEngine(
        orpheus_adapter(seed), CacheConfig(num_slots=num_slots, max_seq_len=max_seq_len, **(cache or {})),
        SchedulerConfig(**{**defaults, **sched}), seed=seed,
    )  # fmt: skip


def fake_request(req_id: str, prompt_len: int, max_tokens: int = 50, twin_prompt_len: int | None = None) -> Request:
    """A request over fake token ids; with `twin_prompt_len` it is a guided request with a CFG twin."""
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, guidance_scale=None if twin_prompt_len is None else 3.0
    )
    req = Request(req_id, list(range(10, 10 + prompt_len)), params)
    if twin_prompt_len is not None:
        req.twin = Request(f"{req_id}#uncond", list(range(10, 10 + twin_prompt_len)), params, is_twin=True)
    return req


def fake_scheduler(
    num_slots: int = 4, max_batch_size: int = 4, budget: int = 64, max_seq_len: int = 256, cache: dict | None = None
) -> Scheduler:
    """A scheduler whose only stop id is EOS_FAKE; `cache`: more CacheConfig fields (the paged layout)."""
    return Scheduler(
        SchedulerConfig(max_batch_size=max_batch_size, prefill_token_budget=budget),
        CacheConfig(num_slots=num_slots, max_seq_len=max_seq_len, **(cache or {})), [EOS_FAKE],
    )  # fmt: skip


EOS_FAKE = 2


_COSYVOICE2: dict[int, CosyVoice2Adapter] = {}


def cosyvoice2_adapter(seed: int = 0) -> CosyVoice2Adapter:
    """cosyvoice2-tiny adapter, built once per seed per session."""
    if seed not in _COSYVOICE2:
        _COSYVOICE2[seed] = CosyVoice2Adapter.build(ModelConfig(name="cosyvoice2-tiny", seed=seed))
    return _COSYVOICE2[seed]


def adapter_engine(adapter: LMAdapter, num_slots: int = 8, max_seq_len: int = 512, seed: int = 0, **sched) -> LLMEngine:
    """An engine over any adapter, the way the deployments build one."""
    defaults = {"max_batch_size": num_slots, "prefill_token_budget": 64}
    return LLMEngine(
        adapter, CacheConfig(num_slots=num_slots, max_seq_len=max_seq_len),
        SchedulerConfig(**{**defaults, **sched}), seed=seed,
    )  # fmt: skip

"""Dia: greedy parity of the engine (encoder at prefill, decoder on slot KV cache, CFG pairs) with
transformers' own `DiaForConditionalGeneration.generate()`, 5 concurrent guided requests with
staggered joins; Dia's EOS channel rules; checkpoint round trip."""

from __future__ import annotations

import functools

import pytest
import torch

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from llm_stage.engine import LLMEngine
from llm_stage.models.dia import DiaAdapter, encode_dia_text
from llm_stage.request import Request
from tests.factories import STEP_MODES


@functools.cache
def adapter() -> DiaAdapter:
    return DiaAdapter.build(ModelConfig(name="dia-tiny", seed=11))


def hf_steps(text: str, scale: float | None, top_k: int | None, max_new: int) -> list[tuple]:
    """transformers' Dia generation for one request, with the processor's delayed BOS prefix
    (channel c holds BOS through step delay[c]) as `decoder_input_ids`. Returns generated steps."""
    ad = adapter()
    delays, bos, pad = ad.pattern.delays, ad.pattern.bos_id, ad.pattern.pad_id
    prefix = torch.full((1, 1 + max(delays), len(delays)), pad)
    for c, d in enumerate(delays):
        prefix[0, : d + 1, c] = bos
    ids = torch.tensor([encode_dia_text(text)])
    out = ad.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=prefix,
        decoder_attention_mask=torch.ones(prefix.shape[:2], dtype=torch.long), max_new_tokens=max_new,
        do_sample=False, guidance_scale=scale, top_k=top_k,
    )  # fmt: skip
    return [tuple(step) for step in out[0, 1:].tolist()]


CASES = {  # req_id: (text, guidance_scale, top_k, max_tokens, join step)
    "a": ("[S1] hi", 3.0, None, 24, 0),
    "b": ("[S1] a somewhat longer line of text. [S2] yes.", 3.0, None, 20, 0),
    "c": ("third one", 2.0, 3, 22, 2),
    "d": ("the fourth request joins late", 3.0, None, 18, 5),
    "e": ("plain", None, None, 16, 5),
}


@pytest.mark.parametrize(("async_steps", "kv_layout"), STEP_MODES, indirect=["kv_layout"])
def test_greedy_parity_with_transformers_dia_generate_cfg_on(async_steps, kv_layout):
    ad = adapter()
    engine = LLMEngine(
        ad,
        CacheConfig(num_slots=10, max_seq_len=128),
        SchedulerConfig(max_batch_size=10, prefill_token_budget=24, async_steps=async_steps),
    )
    steps: dict[str, list] = {k: [] for k in CASES}
    frames: dict[str, list] = {k: [] for k in CASES}
    most_rows = 0
    for tick in range(300):
        for req_id, (text, scale, top_k, max_tokens, join) in CASES.items():
            if join == tick:
                params = {"temperature": 0.0, "max_tokens": max_tokens, "guidance_scale": scale, "top_k": top_k or 0}
                engine.add_request(req_id, text, None, params)
        for out in engine.step():
            assert "#" not in out.req_id  # twins are never emitted
            if out.new_token_ids:
                steps[out.req_id].append(tuple(out.new_token_ids))
            frames[out.req_id].extend(out.new_frames)
        most_rows = max(most_rows, engine.scheduler.slots.num_used)
        if tick > 5 and not engine.has_work:
            break
    assert most_rows >= 8  # at least 4 guided pairs shared the batch
    for req_id, (text, scale, top_k, max_tokens, _) in CASES.items():
        want = hf_steps(text, scale, top_k, max_tokens)
        assert steps[req_id] == want[:-1], req_id  # HF also returns the final all-EOS/PAD step
        audio = [f for f in ad.pattern.deinterleave([list(s) for s in want]) if max(f) < ad.eos_id]
        assert frames[req_id] == audio, req_id
    assert engine.scheduler.slots.num_free == 10


def test_preempted_pair_re_encodes_and_continues_identically():
    """Preemption frees both slots; the re-prefill re-buffers the text and re-runs the encoder."""
    ad = adapter()
    engine = LLMEngine(ad, CacheConfig(num_slots=4, max_seq_len=64), SchedulerConfig(max_batch_size=4))
    params = {"temperature": 0.0, "top_k": 0, "max_tokens": 24, "guidance_scale": 3.0}
    engine.add_request("p", "[S1] preempt me", None, params)
    steps = []
    for tick in range(100):
        if tick == 6:
            assert engine.scheduler.preempt("p")
        steps += [tuple(o.new_token_ids) for o in engine.step() if o.new_token_ids]
        if not engine.has_work:
            break
    assert steps == hf_steps("[S1] preempt me", 3.0, None, 24)[:-1]


def fake_req(outputs: list[tuple], max_tokens: int = 100) -> Request:
    req = Request("r", [], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    req.output_ids = list(outputs)
    return req


def test_eos_channel_filter_and_cascade():
    ad = adapter()
    eos, pad, bos, k = ad.eos_id, ad.pattern.pad_id, ad.pattern.bos_id, ad.num_codebooks
    free = tuple(range(k))
    logits = torch.zeros(2, k, ad.vocab_size)
    logits[:, :, eos:] = 5.0  # every special id on top: only channel 0's EOS survives, and only on row 0
    logits[1, 0, 3] = 9.0
    picks = ad.constrain(logits, [fake_req([free] * 10), fake_req([free] * 10)]).argmax(-1).tolist()
    assert picks[0][0] == eos and all(p < eos for p in picks[0][1:])
    assert picks[1][0] == 3 and all(p < eos for p in picks[1])
    early = ad.constrain(torch.zeros(1, k, ad.vocab_size), [fake_req([])]).argmax(-1)[0].tolist()
    assert early[1:] == [bos] * (k - 1)  # before its delay a channel holds BOS
    history = [free] * 10 + [(eos, *free[1:])]
    after = ad.constrain(torch.zeros(1, k, ad.vocab_size), [fake_req(history)]).argmax(-1)[0].tolist()
    assert after[0] == pad  # channel 0 pads after its EOS; channel c ends delays[c] steps after it
    tail = history + [free] * (max(ad.pattern.delays) - 1)  # the next step is the last channel's EOS
    assert not ad.is_stop(fake_req(tail[:-1]), free) and ad.is_stop(fake_req(tail), free)


def test_unconditional_twin_is_zero_text_of_same_length_and_long_text_rejected():
    ad = adapter()
    cond, uncond = ad.format_prompt("[S1] ab", None), ad.unconditional_prompt("[S1] ab", None)
    assert [p[-1] for p in cond[:-1]] == [1, 32, 97, 98] and [p[-1] for p in uncond[:-1]] == [0] * 4
    assert cond[-1] == uncond[-1]
    with pytest.raises(InvalidArgumentError) as err:
        ad.format_prompt("x" * (ad.max_text_tokens + 1), None)
    assert err.value.field == "text"


def test_checkpoint_round_trip(tmp_path):
    ad = adapter()
    ad.model.save_pretrained(str(tmp_path))
    loaded = DiaAdapter.build(ModelConfig(name="dia", checkpoint_dir=tmp_path, codec_dir=tmp_path))
    for name, tensor in ad.model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], tensor)
    assert loaded.pattern == ad.pattern

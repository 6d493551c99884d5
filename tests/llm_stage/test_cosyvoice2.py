"""CosyVoice 2 LM on our engine: greedy tokens of batched, chunked, staggered requests equal a
plain transformers Qwen2ForCausalLM loop over the published input layout on the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from core.messages import SamplingParams
from llm_stage.models.cosyvoice2 import EOS_TOKEN, STOP_TOKENS, CosyVoice2Adapter, Kind
from llm_stage.models.cosyvoice2_lm import SPEECH_TOKEN_SIZE, SPEECH_VOCAB, CosyVoice2LM
from llm_stage.request import FinishReason, Request
from tests.factories import STEP_MODES, adapter_engine, cosyvoice2_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@torch.inference_mode()
def reference_loop(
    model: CosyVoice2LM, text_ids: list[int], max_new: int, prompt_text_ids=(), prompt_speech=()
) -> tuple[list[int], list[torch.Tensor]]:
    """The published Qwen2LM inference loop, greedy: input [sos, prompt text + text, task_id, prompt
    speech], EOS masked for 2x the text tokens, at most 20x, any of the 3 stop ids ends it. Returns
    the tokens and each step's llm_decoder scores."""
    qwen = model.qwen
    text = torch.tensor([[*prompt_text_ids, *text_ids]])
    parts = [
        model.llm_embedding.weight[0].view(1, 1, -1),
        qwen.model.embed_tokens(text),
        model.llm_embedding.weight[1].view(1, 1, -1),
        model.speech_embedding(torch.tensor([list(prompt_speech)], dtype=torch.long)),
    ]
    embeds = torch.cat(parts, dim=1)
    min_len, max_len = 2 * len(text_ids), 20 * len(text_ids)
    cache, out, scores = DynamicCache(config=qwen.config), [], []
    for step in range(min(max_len, max_new)):
        hidden = qwen.model(inputs_embeds=embeds, cache=cache, use_cache=True).last_hidden_state
        scores.append(model.llm_decoder(hidden[0, -1]))
        logp = scores[-1].log_softmax(dim=-1)
        if step < min_len:
            logp[EOS_TOKEN] = float("-inf")
        top = int(logp.argmax())
        if top in STOP_TOKENS:
            break
        out.append(top)
        embeds = model.speech_embedding.weight[top].view(1, 1, -1)
    return out, scores


def reference_greedy(model: CosyVoice2LM, text_ids: list[int], max_new: int, prompt_text_ids=(), prompt_speech=()):
    return reference_loop(model, text_ids, max_new, prompt_text_ids, prompt_speech)[0]


CASES = {  # req_id: (text, prompt text, prompt speech tokens, step it joins at)
    "a": ("hello world", "", [], 0),
    "b": ("hi", "", [], 0),
    "c": ("a longer sentence to speak, with a comma.", "", [], 3),
    "voice": ("what the voice says", "the clip's words", [17, 6000, 6560, 3, 3, 42], 5),
    "d": ("x", "", [], 9),
}


@pytest.mark.parametrize(("async_steps", "kv_layout"), STEP_MODES, indirect=["kv_layout"])
def test_greedy_tokens_equal_a_transformers_qwen2_loop(async_steps, kv_layout):
    adapter = cosyvoice2_adapter()
    engine = adapter_engine(adapter, num_slots=4, prefill_token_budget=16, async_steps=async_steps)
    got: dict[str, list[int]] = {req_id: [] for req_id in CASES}
    for step in range(400):
        for req_id, (text, prompt_text, speech, join_at) in CASES.items():
            if join_at == step:
                engine.add_prompt(req_id, adapter.voice_prompt(text, prompt_text, speech), GREEDY)
        for out in engine.step():
            got[out.req_id].extend(out.new_token_ids)
        if step > 9 and not engine.has_work:
            break
    for req_id, (text, prompt_text, speech, _) in CASES.items():
        encode = adapter.tokenizer.encode
        want = reference_greedy(adapter.model, encode(text), GREEDY.max_tokens, encode(prompt_text), speech)
        assert got[req_id] == want, req_id
    assert len(got["d"]) == 20  # one text token: at most 20 speech tokens, fewer than max_tokens


def test_logits_of_every_step_equal_the_transformers_loop():
    """Scores of batched, chunked rows (recorded as the engine computes them) against the loop's, step by step."""
    adapter = cosyvoice2_adapter()
    recorded: dict[str, list[torch.Tensor]] = {}
    logits = adapter.logits

    def recording(hidden, reqs):
        out = logits(hidden, reqs)
        for req, row in zip(reqs, out[0], strict=True):
            recorded.setdefault(req.req_id, []).append(row.clone())
        return out

    engine = adapter_engine(adapter, num_slots=4, prefill_token_budget=16)
    engine.adapter = copy.copy(adapter)
    engine.adapter.logits = recording
    for req_id, (text, prompt_text, speech, _) in CASES.items():
        engine.add_prompt(req_id, adapter.voice_prompt(text, prompt_text, speech), GREEDY)
    engine.run_to_completion()
    worst = 0.0
    for req_id, (text, prompt_text, speech, _) in CASES.items():
        encode = adapter.tokenizer.encode
        _, want = reference_loop(adapter.model, encode(text), GREEDY.max_tokens, encode(prompt_text), speech)
        got = recorded[req_id][: len(want)]  # at 20x the text the engine runs one more step: the forced stop
        assert len(got) == len(want), req_id
        for got_row, want_row in zip(got, want, strict=True):
            torch.testing.assert_close(got_row, want_row, rtol=1e-4, atol=1e-4)
            worst = max(worst, float((got_row - want_row).abs().max()))
    print(f"max |logit difference|: {worst:.2e}")


def test_stop_at_the_minimum_length_when_eos_dominates():
    model = copy.deepcopy(cosyvoice2_adapter().model)
    with torch.no_grad():
        model.llm_decoder.bias[EOS_TOKEN] += 1e4  # EOS is every step's argmax once it is allowed
    adapter = CosyVoice2Adapter(model, cosyvoice2_adapter().tokenizer)
    engine = adapter_engine(adapter, num_slots=2)
    requests = {text: engine.add_request(text, text, sampling={"temperature": 0.0}) for text in ("hi", "hello")}
    got = engine.run_to_completion()
    for text, req in requests.items():
        text_ids = adapter.tokenizer.encode(text)
        assert got[text] == reference_greedy(model, text_ids, 100)
        assert len(got[text]) == 2 * len(text_ids) and req.finish_reason is FinishReason.STOP


def test_prompt_layout_and_embeddings_follow_the_published_tables():
    adapter = cosyvoice2_adapter()
    prompt = adapter.voice_prompt("ab", "c", [5, 6])
    a, b, c = adapter.tokenizer.encode("abc")
    assert prompt == [(0, Kind.LLM), (c, Kind.PROMPT_TEXT), (a, Kind.TEXT), (b, Kind.TEXT), (1, Kind.LLM),
                      (5, Kind.SPEECH), (6, Kind.SPEECH)]  # fmt: skip
    lanes = torch.tensor([[adapter.token_lanes(t) for t in [*prompt, 6563]]])
    embeds = adapter.embed(lanes)[0]
    model = adapter.model
    want = torch.stack([
        model.llm_embedding.weight[0], *model.qwen.model.embed_tokens.weight[[c, a, b]], model.llm_embedding.weight[1],
        *model.speech_embedding.weight[[5, 6, 6563]],
    ])  # fmt: skip
    torch.testing.assert_close(embeds, want, rtol=0, atol=0)
    assert model.speech_embedding.num_embeddings == SPEECH_VOCAB == 6564
    assert adapter.new_frame_builder().push(17) == [[17]]


def test_length_bounds_mask_eos_then_force_it():
    adapter = cosyvoice2_adapter()
    req = Request("r", adapter.voice_prompt("abc", "long transcript", [1, 2]), GREEDY)  # 3 text tokens
    assert adapter.length_bounds(req) == (6, 60)
    for generated, allowed_eos, only_eos in ((0, False, False), (5, False, False), (6, True, False), (60, True, True)):
        req.output_ids = [7] * generated
        logits = adapter.constrain(torch.zeros(1, SPEECH_VOCAB), [req])
        assert (logits[0, EOS_TOKEN] == 0.0) == allowed_eos
        assert bool(torch.isfinite(logits[0, :EOS_TOKEN]).any()) != only_eos
        assert bool(torch.isfinite(logits[0, EOS_TOKEN + 1 :]).all()) != only_eos  # 6562 / 6563 stay allowed


def test_repetition_penalty_sees_speech_ids_only():
    adapter = cosyvoice2_adapter()
    tokens = [*adapter.voice_prompt("ab", "", [9, 10]), 11, 12]
    assert adapter.history_ids(tokens, 0) == [9, 10, 11, 12]
    engine = adapter_engine(adapter, num_slots=2)
    engine.add_request("p", "hello", sampling={"temperature": 0.9, "repetition_penalty": 1.5, "seed": 3,
                                               "max_tokens": 12})  # fmt: skip
    tokens = engine.run_to_completion()["p"]
    assert 0 < len(tokens) <= 12 and all(0 <= t < SPEECH_TOKEN_SIZE for t in tokens)

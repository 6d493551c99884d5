"""Qwen3-TTS LM side: talker-in-engine + batched code predictor against a plain loop on transformers'
own Qwen3 decoder and its Qwen3-Omni code predictor (the same modules when the predictor is as wide as
the talker), 3 concurrent requests with staggered joins; the prompt layout; sampling rules.
(Parity with the qwen-tts package itself: tests/llm_stage/test_qwen3_tts_golden.py.)"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3Model
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerCodePredictorConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration as OmniCodePredictor,
)

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from llm_stage.engine import LLMEngine
from llm_stage.models.qwen3_tts import NONE, PresetChatTokenizer, Qwen3TTSAdapter, tiny_qwen3_tts_config
from llm_stage.models.qwen3_tts_talker import Qwen3TTSModel, TalkerSpec, qwen3_config
from llm_stage.request import Request
from tests.factories import STEP_MODES


def widened(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights wider than the default init, so greedy picks are not near-ties."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def run(engine: LLMEngine) -> list[list[int]]:
    frames: list[list[int]] = []
    while engine.has_work:
        frames.extend(f for out in engine.step() for f in out.new_frames)
    return frames


@functools.cache
def adapter(predictor_width: int = 64) -> Qwen3TTSAdapter:
    config = tiny_qwen3_tts_config()
    config["talker_config"]["code_predictor_config"]["hidden_size"] = predictor_width
    model = widened(Qwen3TTSModel(TalkerSpec.from_config(config)), seed=3).eval()
    return Qwen3TTSAdapter(model, PresetChatTokenizer())


def transformers_frames(ad: Qwen3TTSAdapter, prompt: list[tuple], num_frames: int, penalty: float) -> list[list[int]]:
    """Greedy frames from transformers' Qwen3Model (the whole sequence again each step) and its Qwen3-Omni
    code predictor's `generate`, with the reference's rules: special ids masked, no EOS before frame 2,
    repetition penalty over generated codebook-0 ids."""
    talker, spec = ad.model.talker, ad.spec
    decoder = Qwen3Model(qwen3_config(spec.talker)).eval()
    stack = {k: v for k, v in talker.model.state_dict().items() if k.split(".")[0] in ("layers", "norm")}
    decoder.load_state_dict({"embed_tokens.weight": talker.model.codec_embedding.weight, **stack})
    cp_fields = spec.predictor
    cp_config = Qwen3OmniMoeTalkerCodePredictorConfig(
        **{k: cp_fields[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim", "num_code_groups")},
        rope_parameters={"rope_type": "default", "rope_theta": float(cp_fields["rope_theta"])},
    )  # fmt: skip
    predictor = OmniCodePredictor(cp_config).eval()
    predictor.load_state_dict(talker.code_predictor.state_dict())
    positions, frames = list(prompt), []
    with torch.no_grad():
        for step in range(num_frames):
            embeds = ad.embed(torch.tensor([[ad.token_lanes(p) for p in positions]]))
            hidden = decoder(inputs_embeds=embeds).last_hidden_state[:, -1]
            logits = talker.codec_head(hidden)[0]
            logits[ad.suppressed] = float("-inf")
            if step < 2:
                logits[ad.eos_code] = float("-inf")
            for code in {f[0] for f in frames}:
                logits[code] = logits[code] / penalty if logits[code] > 0 else logits[code] * penalty
            first = int(logits.argmax())
            if first == ad.eos_code:
                break
            start = torch.stack([hidden, talker.model.codec_embedding(torch.tensor([first]))], dim=1)
            rest = predictor.generate(inputs_embeds=start, max_new_tokens=spec.num_codebooks - 1, do_sample=False)
            frames.append([first, *rest[0, -(spec.num_codebooks - 1) :].tolist()])
            positions.append(tuple(frames[-1]))
    return frames


@pytest.mark.parametrize(("async_steps", "kv_layout"), STEP_MODES, indirect=["kv_layout"])
def test_greedy_frames_match_transformers_qwen3_and_omni_code_predictor(async_steps, kv_layout):
    ad = adapter()
    engine = LLMEngine(
        ad, CacheConfig(num_slots=4, max_seq_len=128),
        SchedulerConfig(max_batch_size=4, prefill_token_budget=16, async_steps=async_steps),
    )  # fmt: skip
    requests = {"a": ("Hello there.", "ryan", 0), "b": ("A longer line of text.", "eric", 0), "c": ("Hi", "vivian", 3)}
    prompts = {k: ad.format_prompt(text, voice) for k, (text, voice, _) in requests.items()}
    sampling = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=9)
    frames: dict[str, list] = {k: [] for k in requests}
    for step in range(100):
        for req_id, (_, _, join_at) in requests.items():
            if join_at == step:
                engine.add_prompt(req_id, prompts[req_id], sampling)
        for out in engine.step():
            frames[out.req_id].extend(out.new_frames)
        if step > 3 and not engine.has_work:
            break
    for req_id, prompt in prompts.items():
        assert frames[req_id] == transformers_frames(ad, prompt, 9, penalty=1.3), req_id
        assert len(frames[req_id]) >= 2


def test_narrow_code_predictor_projects_its_input():
    ad = adapter(predictor_width=32)
    projection = ad.model.talker.code_predictor.small_to_mtp_projection
    assert isinstance(projection, torch.nn.Linear) and projection.weight.shape == (32, 64)
    engine = LLMEngine(ad, CacheConfig(num_slots=2, max_seq_len=128), SchedulerConfig(max_batch_size=2))
    engine.add_prompt("r", ad.format_prompt("Hey", None), SamplingParams(temperature=0.0, max_tokens=4))
    frames = run(engine)
    assert len(frames) == 4 and all(len(f) == 4 and all(0 <= c < 64 for c in f) for f in frames)


def test_prompt_is_the_reference_non_streaming_custom_voice_layout():
    ad = adapter()
    f, spec = ad.spec.talker, ad.spec
    text_ids = PresetChatTokenizer().chat_ids("Hi")[1]
    prompt = ad.format_prompt("Hi", "ryan")
    codec = [p[0] for p in prompt]
    text = [p[-1] for p in prompt]
    assert all(p[1:-1] == (NONE,) * 3 for p in prompt)  # codebooks 1..K-1 are unset in the prompt
    speaker = f["spk_id"]["ryan"]
    assert codec == [NONE] * 3 + [f["codec_nothink_id"], f["codec_think_bos_id"], f["codec_think_eos_id"], speaker,
                                  f["codec_pad_id"]] + [f["codec_pad_id"]] * 3 + [f["codec_bos_id"]]  # fmt: skip
    pad = spec.tts_pad_id
    assert text == [1, 6, 7, pad, pad, pad, pad, spec.tts_bos_id, *text_ids, spec.tts_eos_id, pad]
    dialect = ad.format_prompt("Hi", "eric")  # a dialect speaker thinks in its dialect under language `auto`
    sichuan = f["codec_language_id"]["sichuan_dialect"]
    assert [p[0] for p in dialect][3:7] == [
        f["codec_think_id"],
        f["codec_think_bos_id"],
        sichuan,
        f["codec_think_eos_id"],
    ]
    assert len(ad.format_prompt("Hi", None)) == len(prompt) - 1  # no speaker position
    with pytest.raises(InvalidArgumentError) as err:
        ad.format_prompt("Hi", "nobody")
    assert err.value.field == "voice"


def test_special_ids_are_never_sampled_and_eos_waits_two_frames():
    ad = adapter()
    vocab = ad.spec.talker["vocab_size"]
    reqs = [Request("new", [], SamplingParams()), Request("old", [], SamplingParams())]
    reqs[1].output_ids = [(1, 2, 3, 4)] * 2
    logits = ad.constrain(torch.zeros(2, vocab), reqs)
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed[0] == list(range(vocab - 1024)) and allowed[1] == [*range(vocab - 1024), ad.eos_code]
    assert ad.is_stop(reqs[0], (ad.eos_code, 0, 0, 0)) and not ad.is_stop(reqs[0], (0, ad.eos_code, 0, 0))
    assert ad.penalty_history(reqs[1], 0) == [1, 1] and ad.penalty_history(reqs[1], 2) == []
    padded = ad.constrain(torch.zeros(3, vocab), reqs)  # a graph's padding row past the requests: untouched
    assert torch.equal(padded[:2], logits) and torch.isfinite(padded[2, ad.eos_code])


def test_preset_builds_from_its_config_and_synthesizes_with_default_sampling():
    ad = Qwen3TTSAdapter.build(ModelConfig(name="qwen3-tts-tiny", seed=1))
    assert ad.num_codebooks == 4 and ad.input_width == 5 and set(ad.voices) == set(ad.speaker_ids)
    again = Qwen3TTSAdapter.build(ModelConfig(name="qwen3-tts-tiny", seed=1))
    weights, same = ad.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(weights[name], same[name]) for name in weights)
    engine = LLMEngine(ad, CacheConfig(num_slots=2, max_seq_len=64), SchedulerConfig(max_batch_size=2))
    engine.add_request("r", "Hello", None, {"max_tokens": 6, "seed": 3})
    frames = run(engine)
    assert 0 < len(frames) <= 6

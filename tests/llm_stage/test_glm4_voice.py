"""GLM-4-Voice 9B's LM side: the published ChatGLM layout loads back through the family; greedy tokens of a
batch of mixed-length prompts through our engine equal transformers' GlmForCausalLM on the same weights;
the prompt is the published demo's (hand-written ids; GLM-4's BPE checked against tiktoken's rule);
answers split into text and speech codes and stop at `<|user|>`; text-only answers draw text alone; bad
inputs are refused naming the field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import regex
import torch
from transformers import GlmForCausalLM

from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import AudioClip, ChatTurn
from llm_stage.models.glm4_bpe import GLM4_PATTERN, GLM4Tokenizer
from llm_stage.models.glm4_voice import (
    FAMILY,
    GLM4_VOICE_SCHEDULE,
    SPEECH_SYSTEM,
    TEXT_SYSTEM,
    Glm4VoiceAdapter,
)
from llm_stage.models.glm4_voice_lm import INV_FREQ_KEY, SpecialIds, glm_config, load_published, tiny_config
from llm_stage.registry import get_entry, model_config_for
from llm_stage.side import LLMSide
from tests.factories import STEP_MODES, adapter_engine
from tests.glm4_voice_layout import bpe_ranks, glm4_voice_state, write_glm4_voice
from tests.glm4_voice_tokenizer_layout import write_glm4_voice_tokenizer

IDS = SpecialIds()
GREEDY = {"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 12}
PROMPTS = ("hello", "the stream of text is streaming audio tokens", "User: hello hello", "a b c")


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Glm4VoiceAdapter, dict[str, torch.Tensor], Path]:
    """The adapter as `voxray serve --model DIR` builds it from the written layout, the weights written, the dir."""
    state = glm4_voice_state(seed=3)
    directory = write_glm4_voice(tmp_path_factory.mktemp("glm-4-voice-9b"), state)
    speech_tokenizer = write_glm4_voice_tokenizer(tmp_path_factory.mktemp("glm-4-voice-tokenizer"))
    config = model_config_for(directory)
    assert config.name == "glm4-voice"
    config = config.model_copy(update={"speech_tokenizer_dir": speech_tokenizer})
    return Glm4VoiceAdapter.build(config), state, directory


@pytest.fixture(scope="module")
def preset() -> Glm4VoiceAdapter:
    return Glm4VoiceAdapter.build(ModelConfig(name="glm4-voice-tiny", seed=0))


def transformers_glm(state: dict[str, torch.Tensor]) -> GlmForCausalLM:
    """transformers' GLM on the published tensors, converted as its ChatGLM converter does: q / k / v rows
    split from query_key_value, dense_h_to_4h as gate_up_proj, no other change."""
    config = glm_config(tiny_config())
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    names = {"word_embeddings": "model.embed_tokens", "final_layernorm": "model.norm", "output_layer": "lm_head",
             "self_attention.dense": "self_attn.o_proj", "mlp.dense_h_to_4h": "mlp.gate_up_proj",
             "mlp.dense_4h_to_h": "mlp.down_proj"}  # fmt: skip
    converted = {}
    for key, tensor in state.items():
        if key == INV_FREQ_KEY:
            continue
        new = key.replace("transformer.encoder.layers.", "model.layers.").replace("transformer.embedding.", "")
        new = new.replace("transformer.encoder.", "").replace("transformer.", "")
        if ".query_key_value." in new:
            part = new.rsplit(".", 1)[1]
            q, k, v = tensor.split([heads * dim, kv_heads * dim, kv_heads * dim])
            layer = new.split(".self_attention.")[0]
            converted.update({f"{layer}.self_attn.{p}_proj.{part}": t for p, t in zip("qkv", (q, k, v), strict=True)})
            continue
        for old, name in names.items():
            new = new.replace(old, name)
        converted[new] = tensor
    model = GlmForCausalLM(config).eval()
    model.load_state_dict(converted, strict=True)
    return model


def reference_greedy(model: GlmForCausalLM, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=max_new,
        do_sample=False, eos_token_id=sorted(IDS.stops), pad_token_id=IDS.endoftext,
    )  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    return tokens[:-1] if tokens and tokens[-1] in IDS.stops else tokens


def test_published_layout_loads_through_the_family(published) -> None:
    adapter, state, directory = published
    assert adapter.ids == IDS and FAMILY.is_checkpoint(json.loads((directory / "config.json").read_text()))
    body = adapter.model
    assert not any(t.is_meta for t in [*body.parameters(), *body.buffers()])  # built on meta, all assigned
    torch.testing.assert_close(body.model.embed_tokens.weight, state["transformer.embedding.word_embeddings.weight"])
    torch.testing.assert_close(body.lm_head.weight, state["transformer.output_layer.weight"])
    v_rows = state["transformer.encoder.layers.1.self_attention.query_key_value.weight"][-32:]
    torch.testing.assert_close(body.model.layers[1].self_attn.v_proj.weight, v_rows)  # v is never permuted
    assert get_entry("glm4-voice").family is FAMILY and FAMILY.frame_rate_hz == 12.5


@pytest.fixture(scope="module")
def reference(published) -> dict[str, list[int]]:
    """transformers' greedy tokens of each prompt, alone."""
    adapter, state, _ = published
    model = transformers_glm(state)
    with torch.no_grad():
        return {
            text: reference_greedy(model, adapter.format_prompt(text, None), GREEDY["max_tokens"]) for text in PROMPTS
        }


@pytest.mark.parametrize(("async_steps", "kv_layout"), STEP_MODES, indirect=["kv_layout"])
def test_greedy_tokens_of_a_mixed_batch_equal_transformers_glm(published, reference, async_steps, kv_layout) -> None:
    """Prompts of four lengths, prefilled in 48-token chunks, joining at steps 0, 0, 3 and 5 of one batch."""
    adapter = published[0]
    engine = adapter_engine(adapter, num_slots=4, max_seq_len=512, prefill_token_budget=48, async_steps=async_steps)
    join_at = {0: (0, 1), 3: (2,), 5: (3,)}
    ours: dict[str, list[int]] = {}
    for step in range(200):
        for i in join_at.get(step, ()):
            request = engine.add_request(f"g{i}", PROMPTS[i], sampling=GREEDY)
            assert request.prompt_ids == adapter.format_prompt(PROMPTS[i], None)
        if step > max(join_at) and not engine.has_work:
            break
        for out in engine.step():
            ours.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert len({len(adapter.format_prompt(text, None)) for text in PROMPTS}) == len(PROMPTS)
    assert [ours[f"g{i}"] for i in range(len(PROMPTS))] == [reference[text] for text in PROMPTS]
    assert any(IDS.audio_code(t) is not None for tokens in reference.values() for t in tokens)


def tiktoken_rule(ranks: dict[bytes, int], text: str) -> list[int]:
    """tiktoken's BPE, written plainly: split by GLM-4's pattern, then merge the lowest-ranked pair until none."""
    ids = []
    for piece in regex.findall(GLM4_PATTERN, text):
        parts = [bytes([b]) for b in piece.encode()]
        while True:
            pairs = [(ranks.get(a + b, 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))]
            rank, at = min(pairs, default=(1 << 30, -1))
            if rank == 1 << 30:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def test_prompt_is_the_published_demo_prompt(published) -> None:
    adapter, _, directory = published
    ranks = bpe_ranks()
    tokenizer = GLM4Tokenizer(directory)
    for sample in ("hello  the\n\n streaming 12345 tokens's ünï 你好!!", "User:\ttext\r\n  audio"):
        assert tokenizer.encode(sample) == tiktoken_rule(ranks, sample)
        assert tokenizer.decode(tokenizer.encode(sample) + [IDS.user]) == sample
    text = "hello the streaming audio, text tokens"
    engine = adapter_engine(adapter, num_slots=2, max_seq_len=512)
    engine.add_request("p", text)
    opening = tiktoken_rule(ranks, "streaming_transcription\n")
    expected = [151331, 151333, 151335, *tiktoken_rule(ranks, "\n" + TEXT_SYSTEM), 151336,
                *tiktoken_rule(ranks, "\n" + text), 151337, *opening]  # fmt: skip
    assert engine.requests["p"].prompt_ids == expected
    assert opening == [ranks[b"streaming"], ranks[b"_transcription"], 10]
    engine.cancel("p")


def test_prompt_of_a_conversation_with_speech_tokens(preset) -> None:
    """Hand-written ids (the preset's byte tokenizer: byte b is 1000 + b): system, an earlier text turn and
    its answer, then a turn with text and a clip's speech tokens."""
    spell = lambda s: [1000 + b for b in s.encode()]  # noqa: E731
    earlier = [("user", "hi", None), ("assistant", "yo ", None)]
    prompt = preset.chat_prompt(earlier, "ok", [0, 5, 16383], "S")
    assert prompt == [
        151331, 151333, 151335, 1010, 1083,  # [gMASK] <sop> <|system|> "\nS"
        151336, 1010, 1104, 1105, 151337, *spell("streaming_transcription\nyo"),  # the answer, rstripped
        151336, 1010, 1111, 1107, 151343, 152353, 152358, 168736, 151344,  # "\nok" + its clip's speech tokens
        151337, *spell("streaming_transcription\n"),
    ]  # fmt: skip
    engine = adapter_engine(preset, num_slots=2, max_seq_len=1024)
    history = (ChatTurn("user", "hi"), ChatTurn("assistant", "yo "))
    engine.add_job(dataclasses.replace(engine.job("c", "ok"), history=history, system="S"))
    assert engine.requests["c"].prompt_ids == preset.chat_prompt(earlier, "ok", None, "S")
    engine.cancel("c")
    assert SPEECH_SYSTEM.endswith("tokens. ") and TEXT_SYSTEM.endswith("tokens.")


def test_answers_route_text_to_the_client_speech_to_the_detokenizer_and_stop_at_user(preset) -> None:
    builder = preset.new_frame_builder()
    answer = [1072, 1105, IDS.first_audio, IDS.first_audio + 16383, IDS.begin_of_audio, 1033]
    assert preset.text_ids(answer) == [1072, 1105, 1033] and preset.decode_text([1072, 1105]) == "Hi"
    assert [builder.push(t) for t in answer] == [[], [], [[0]], [[16383]], [], []]
    assert all(preset.is_stop(None, t) for t in (IDS.user, IDS.endoftext, IDS.observation))
    assert not preset.is_stop(None, IDS.assistant) and not preset.is_stop(None, IDS.first_audio)
    engine = adapter_engine(preset, num_slots=2, max_seq_len=1024)
    engine.add_request("s", "Tell me a story.", sampling={"temperature": 0.0, "max_tokens": 60})
    tokens = engine.run_to_completion()["s"]
    assert all(preset.ids.is_text(t) or preset.ids.audio_code(t) is not None for t in tokens)
    assert any(preset.ids.audio_code(t) is not None for t in tokens) and IDS.user not in tokens


def test_the_side_streams_text_deltas_and_speech_chunks_on_the_family_schedule(preset) -> None:
    """Through `LLMSide`: the answer's text ids arrive as TextDeltas, its speech codes as chunks of 25, then
    50, ... frames, each carrying the whole stream before it (a cold detokenizer rebuilds from frame 0)."""
    sampling = {"temperature": 0.0, "max_tokens": 150}
    reference = adapter_engine(preset, num_slots=2, max_seq_len=1024)
    reference.add_request("s", "Tell me a story.", sampling=sampling)
    tokens = reference.run_to_completion()["s"]
    engine = adapter_engine(preset, num_slots=2, max_seq_len=1024)
    side = LLMSide(engine, GLM4_VOICE_SCHEDULE)
    side.add(engine.job("s", "Tell me a story.", sampling=sampling))
    chunks, deltas = [], []
    while engine.has_work:
        chunks += side.step()
        deltas += side.take_text()
    codes = [c for c in map(IDS.audio_code, tokens) if c is not None]
    assert len(codes) > 75 and [c.keep_end - c.keep_start for c in chunks[:2]] == [25, 50]
    kept = [c.frames[c.keep_start - c.window_start : c.keep_end - c.window_start] for c in chunks]
    assert [frame[0] for frames in kept for frame in frames] == codes
    assert all(c.window_start == 0 for c in chunks) and chunks[-1].is_final
    assert "".join(d.text for d in deltas) == preset.decode_text(preset.text_ids(tokens)) and deltas[-1].is_final


def test_text_only_answers_draw_text_ids_and_stops_alone(preset) -> None:
    engine = adapter_engine(preset, num_slots=2, max_seq_len=1024)
    job = engine.job("t", "Tell me a story.", sampling={"temperature": 1.0, "seed": 4, "max_tokens": 40})
    request = engine.add_job(dataclasses.replace(job, text_only=True))
    logits = torch.zeros(1, 168960)
    logits[0, IDS.first_audio + 7] = 9.0
    logits[0, IDS.user] = 5.0
    logits[0, 1070] = 3.0
    constrained = preset.constrain(logits.clone(), [request])
    assert int(constrained.argmax()) == IDS.user and constrained[0, IDS.first_audio + 7] == float("-inf")
    assert constrained[0, IDS.assistant] == float("-inf") and constrained[0, 1070] == 3.0
    tokens = engine.run_to_completion()["t"]
    assert tokens and all(preset.ids.is_text(t) for t in tokens)
    assert "t" not in preset._text_only  # forgotten with its request


def test_bad_inputs_are_refused_naming_the_field(preset, published, tmp_path) -> None:
    engine = adapter_engine(preset, num_slots=2, max_seq_len=256)
    empty = AudioClip(b"", 16000)  # (the Router's checks refuse it first; the speech tokenizer too)
    cases = [
        (dataclasses.replace(engine.job("a", "hi"), audio=empty), "input_audio"),
        (dataclasses.replace(engine.job("b", "hi"), history=(ChatTurn("user", "x" * 400),)), "text"),  # too long
    ]
    for job, field in cases:
        with pytest.raises(InvalidArgumentError) as err:
            engine.add_job(job)
        assert err.value.field == field
    for args, field in ((([], "", None),), "text"), ((([], "hi", [16384]),), "input_audio"):
        with pytest.raises(InvalidArgumentError) as err:
            preset.chat_prompt(*args[0])
        assert err.value.field == field
    with pytest.raises(InvalidArgumentError) as err:
        Glm4VoiceAdapter.transcription_system("en")
    assert err.value.field == "model"
    directory = published[2]
    for name, change in (("rmsnorm", False), ("kv_channels", None)):
        broken = tmp_path / name
        broken.mkdir()
        config = json.loads((directory / "config.json").read_text())
        config[name] = change
        (broken / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        with pytest.raises(InvalidArgumentError) as err:
            load_published(broken)
        assert err.value.field == "model.checkpoint_dir" and name in err.value.message
    with pytest.raises(InvalidArgumentError) as err:
        SpecialIds.from_vocab({"<|user|>": 151336})
    assert err.value.field == "model.checkpoint_dir" and "<|audio_0|>" in err.value.message
    shifted = {**{name: getattr(IDS, field) for field, name in SpecialIds.NAMES.items()}, "<|audio_1|>": 152355}
    with pytest.raises(InvalidArgumentError) as err:
        SpecialIds.from_vocab(shifted)
    assert err.value.field == "model.checkpoint_dir" and "<|audio_1|>" in err.value.message


def test_pace_counts_the_interleaved_text_steps(preset) -> None:
    """39 steps (13 text + 26 speech) per 26 frames: the engine's timer, the family's steps per audio
    second and the side's steps to a next chunk count them; a family stepping once per token keeps
    its own count (Orpheus: 7 per SNAC frame)."""
    engine = adapter_engine(preset, num_slots=2, max_seq_len=1024)
    assert preset.steps_per_frame == 1.5 and engine.timer.steps_per_frame == 1.5
    assert get_entry("glm4-voice-tiny").family.tokens_per_s == pytest.approx(18.75)
    assert get_entry("orpheus-tiny").family.lm.steps_per_frame == 7.0
    side = LLMSide(engine, GLM4_VOICE_SCHEDULE)
    side.add(engine.job("s", "Tell me a story.", sampling={"temperature": 0.0, "max_tokens": 60}))
    side.step()
    assert engine.requests["s"].tokens_to_next_chunk == 38  # the 25-frame first chunk: ceil(25 x 1.5)

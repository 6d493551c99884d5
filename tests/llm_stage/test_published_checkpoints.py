"""Orpheus, CSM, Dia and Qwen3-TTS load from tiny random checkpoints written in their published layouts
(tests/published_layouts.py) through the real loaders, and match the same models built in memory:
weights, logits, greedy frames through the engine, and CSM's prompt framing against transformers'
own CsmProcessor."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, CsmProcessor, DiaTokenizer

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from core.messages import SamplingParams
from detok_stage.codecs.mimi_codec import MimiCodec
from llm_stage.engine import LLMEngine
from llm_stage.models.csm import CsmAdapter
from llm_stage.models.dia import DiaAdapter, encode_dia_text
from llm_stage.models.llama import LlamaBackbone
from llm_stage.models.orpheus import (
    END_OF_HUMAN,
    END_OF_TEXT,
    START_OF_AI,
    START_OF_HUMAN,
    START_OF_SPEECH,
    OrpheusAdapter,
)
from llm_stage.models.qwen3_tts import PresetChatTokenizer, Qwen3TTSAdapter
from tests.published_layouts import (
    QWEN_SPECIALS,
    csm_model,
    dia_model,
    orpheus_llama,
    qwen2_tokenizer,
    qwen3_tts_model,
    qwen3_tts_tokenizer_model,
    write_csm,
    write_dia,
    write_orpheus,
    write_qwen3_tts,
)


def greedy_frames(adapter, prompt, num_steps: int) -> list[list[int]]:
    engine = LLMEngine(adapter, CacheConfig(num_slots=2, max_seq_len=256), SchedulerConfig(max_batch_size=2))
    engine.add_prompt("r", prompt, SamplingParams(temperature=0.0, max_tokens=num_steps))
    frames: list[list[int]] = []
    while engine.has_work:
        for out in engine.step():
            frames.extend(out.new_frames)
    return frames


def assert_same_weights(loaded: torch.nn.Module, reference: torch.nn.Module, skip: str = "\0") -> None:
    want = {k: v for k, v in reference.state_dict().items() if not k.startswith(skip)}
    got = {k: v for k, v in loaded.state_dict().items() if not k.startswith(skip)}
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


def test_orpheus_published_layout_loads_with_its_tokenizer(tmp_path):
    model = orpheus_llama(seed=1)
    directory = write_orpheus(tmp_path / "orpheus", model)
    assert (directory / "model.safetensors.index.json").is_file()
    assert (directory / "model-00002-of-00002.safetensors").is_file()
    loaded = OrpheusAdapter.build(ModelConfig(name="orpheus", checkpoint_dir=directory))
    assert_same_weights(loaded.backbone.hf_model, model)

    prompt = loaded.format_prompt("Hello there.", "tara")  # the Orpheus framing around the checkpoint's own ids
    body = AutoTokenizer.from_pretrained(str(directory))("tara: Hello there.", add_special_tokens=False).input_ids
    assert prompt == [START_OF_HUMAN, 128000, *body, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.backbone.hf_model(torch.tensor([prompt])).logits, model(torch.tensor([prompt])).logits
        )
    in_memory = OrpheusAdapter(LlamaBackbone(model), loaded.tokenizer)
    frames = greedy_frames(loaded, prompt, 21)
    assert len(frames) == 3 and frames == greedy_frames(in_memory, prompt, 21)


def test_csm_published_layout_frames_like_csm_processor_and_shares_mimi(tmp_path):
    model = csm_model(seed=2)
    directory = write_csm(tmp_path / "csm", model)
    config = ModelConfig(name="csm", checkpoint_dir=directory)
    loaded = CsmAdapter.build(config)
    assert_same_weights(loaded.model, model, skip="codec_model.")

    processor = CsmProcessor.from_pretrained(str(directory))
    for speaker, text in [("0", "Hello there."), ("3", "Ünïcode, punctuation — and [brackets].")]:
        conversation = [{"role": speaker, "content": [{"type": "text", "text": text}]}]
        want = processor.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"][0].tolist()
        assert want[0] == 128000 and want[-1] == 128001  # BOS [speaker]text EOS
        assert [position[-1] for position in loaded.format_prompt(text, speaker)] == want

    codec = MimiCodec.build(config)  # the detokenizer's Mimi is the LM's codec_model: loaded and held once
    assert codec.model is loaded.model.codec_model
    assert_same_weights(codec.model, model.codec_model)
    frames = torch.randint(0, 64, (1, 5, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_audio = model.codec_model.decode(frames.transpose(1, 2)).audio_values[:, 0]
    torch.testing.assert_close(codec.decode(frames), want_audio[:, : codec.decode(frames).shape[1]])

    prompt = loaded.format_prompt("Hi.", "1")
    ids = torch.tensor([[position[-1] for position in prompt]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, model(input_ids=ids).logits)
    in_memory = CsmAdapter(model, loaded.tokenizer)
    frames = greedy_frames(loaded, prompt, 3)
    assert len(frames) == 3 and frames == greedy_frames(in_memory, prompt, 3)


def test_csm_with_a_separate_mimi_repo_uses_that_mimi_for_both_users(tmp_path):
    from tests.published_layouts import mimi_model, write_mimi

    directory = write_csm(tmp_path / "csm", csm_model(seed=2))
    mimi = mimi_model(seed=4)
    config = ModelConfig(name="csm", checkpoint_dir=directory, codec_dir=write_mimi(tmp_path / "mimi", mimi))
    loaded, codec = CsmAdapter.build(config), MimiCodec.build(config)
    assert codec.model is loaded.model.codec_model
    assert_same_weights(codec.model, mimi)


def test_dia_published_layout_loads_and_its_tokenizer_matches_ours(tmp_path):
    model = dia_model(seed=1)  # (seed 3 happens to end at its first step)
    directory = write_dia(tmp_path / "dia", model)
    loaded = DiaAdapter.build(ModelConfig(name="dia", checkpoint_dir=directory))
    assert_same_weights(loaded.model, model)
    text = "[S1] Hello, world. [S2] Ünïcode (laughs)"
    assert DiaTokenizer.from_pretrained(str(directory))(text).input_ids == encode_dia_text(text)
    ids = torch.tensor([encode_dia_text(text)])
    decoder_ids = torch.full((1, 3, 4), 66)  # BOS on every channel
    with torch.no_grad():
        want = model(input_ids=ids, decoder_input_ids=decoder_ids).logits
        torch.testing.assert_close(loaded.model(input_ids=ids, decoder_input_ids=decoder_ids).logits, want)
    prompt = loaded.format_prompt(text, None)
    sampling = loaded.default_sampling.model_copy(update={"temperature": 0.0, "max_tokens": 16})
    engines = [LLMEngine(a, CacheConfig(num_slots=4, max_seq_len=256), SchedulerConfig(max_batch_size=4))
               for a in (loaded, DiaAdapter(model))]  # fmt: skip
    runs = []
    for engine in engines:
        engine.add_prompt("r", prompt, sampling, loaded.unconditional_prompt(text, None))  # CFG on, as published
        frames: list[list[int]] = []
        while engine.has_work:
            for out in engine.step():
                frames.extend(out.new_frames)
        runs.append(frames)
    assert runs[0] and runs[0] == runs[1]


def test_qwen3_tts_published_layout_loads_talker_tokenizer_and_speech_tokenizer(tmp_path):
    from detok_stage.codecs.qwen3_tts_codec import Qwen3TTSCodec

    model, decoder = qwen3_tts_model(seed=1), qwen3_tts_tokenizer_model(seed=2)
    directory = write_qwen3_tts(tmp_path / "qwen3", model, decoder)
    config = ModelConfig(name="qwen3-tts", checkpoint_dir=directory)
    loaded = Qwen3TTSAdapter.build(config)
    assert_same_weights(loaded.model, model)

    text = "Hello, wörld."
    role, body = loaded.tokenizer.chat_ids(text)
    assistant = qwen2_tokenizer()("assistant", add_special_tokens=False).input_ids
    assert len(assistant) == 1 and role == [QWEN_SPECIALS["<|im_start|>"], *assistant, 198]  # 198: "\n" (Ċ)
    assert body == AutoTokenizer.from_pretrained(str(directory))(text, add_special_tokens=False).input_ids
    prompt = loaded.format_prompt(text, "vivian")
    assert [p[-1] for p in prompt][-len(body) - 2 :] == [*body, 151673, 151671]  # tts_eos, then tts_pad over bos
    assert [p[0] for p in prompt][3:8] == [2155, 2156, 2157, 3000, 2148]  # nothink, think bos/eos, speaker, pad

    in_memory = Qwen3TTSAdapter(model.float(), PresetChatTokenizer())
    frames = greedy_frames(loaded, prompt, 5)
    assert len(frames) == 5 and frames == greedy_frames(in_memory, prompt, 5)

    codec = Qwen3TTSCodec.build(config)  # from the checkpoint's speech_tokenizer/ folder
    assert (codec.codes_per_frame, codec.codebook_size, codec.samples_per_frame) == (4, 2048, 1920)
    assert_same_weights(codec.decoder, decoder)
    codes = torch.tensor([frames])
    torch.testing.assert_close(codec.decode(codes), Qwen3TTSCodec(decoder, 24000).decode(codes))
    alone = Qwen3TTSCodec.build(ModelConfig(name="qwen3-tts", codec_dir=directory / "speech_tokenizer"))
    assert_same_weights(alone.decoder, decoder)  # --codec: a standalone tokenizer folder


@pytest.mark.parametrize("name", ["orpheus", "csm", "dia", "qwen3-tts"])
def test_checkpoint_of_another_family_is_rejected(tmp_path, name):
    from core.errors import InvalidArgumentError
    from llm_stage.registry import check_model_config

    directory = write_dia(tmp_path / "dia", dia_model()) if name != "dia" else write_csm(tmp_path / "c", csm_model())
    with pytest.raises(InvalidArgumentError) as err:
        check_model_config(ModelConfig(name=name, checkpoint_dir=directory, codec_dir=directory))
    assert err.value.field == "model.checkpoint_dir" and "checkpoint" in err.value.message

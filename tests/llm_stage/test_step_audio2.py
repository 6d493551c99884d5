"""Step-Audio 2 mini: the published layout loads back; our batched audio encoder equals an independent
solo computation (torch's own attention); greedy tokens through our engine equal transformers' Qwen2
fed the same spliced embeddings; the prompt equals the published chat string tokenized whole;
clips are encoded once per step for every request and dropped when a request ends."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer, Qwen2ForCausalLM

import llm_stage.attention as attention
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import AudioClip, ChatTurn
from llm_stage.decode_graphs import DecodeGraphs
from llm_stage.models.clip_audio import clip_wave_16k
from llm_stage.models.step_audio2 import StepAudio2Adapter
from llm_stage.models.step_audio2_encoder import num_placeholders, piece_log_mel
from llm_stage.models.step_audio2_lm import StepAudio2LM
from llm_stage.registry import model_config_for
from llm_stage.runner import folds_prefill
from tests.factories import adapter_engine, orpheus_adapter
from tests.graph_capture import OpNames
from tests.step_audio2_layout import step_audio2_model, write_step_audio2

CLIP_SAMPLES = (16_000 + 37, 3 * 16_000 + 1234, 8_000 + 1_121)  # odd and even mel lengths


def tone_clip(num_samples: int, seed: int) -> AudioClip:
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / 16_000
    wave = 0.3 * np.sin(2 * np.pi * (180 + 40 * seed) * t) + 0.05 * rng.standard_normal(num_samples)
    return AudioClip((wave * 32767).astype("<i2").tobytes(), 16_000)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[StepAudio2Adapter, StepAudio2LM, Path]:
    """The adapter as `voxray serve --model DIR` builds it from the written layout, the model written, the dir."""
    model = step_audio2_model(seed=3)
    directory = write_step_audio2(tmp_path_factory.mktemp("step-audio-2-mini"), model)
    config = model_config_for(directory)
    assert config.name == "step-audio2"
    return StepAudio2Adapter.build(config), model, directory


def test_published_layout_round_trip(published) -> None:
    adapter, written, _ = published
    loaded = adapter.model.state_dict()
    assert loaded.keys() == written.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in written.state_dict().items())
    assert (adapter.ids.audio_start, adapter.ids.audio_patch, adapter.ids.tts_start) == (151688, 151690, 151693)
    assert adapter.ids.first_audio == 151696 and adapter.model.text_config.vocab_size == 158720


def test_prompt_is_the_published_chat_tokenized_whole(published) -> None:
    adapter, _, directory = published
    engine = adapter_engine(adapter, num_slots=2, max_seq_len=1024)
    clip = tone_clip(CLIP_SAMPLES[0], seed=0)
    engine.add_job(dataclasses.replace(engine.job("p", "Say it back."), audio=clip))
    prompt = [t[0] for t in engine.requests["p"].prompt_ids]
    patches = num_placeholders(piece_log_mel(clip_wave_16k(clip)).shape[1])
    chat = (
        "<|BOT|>system\nYou are a helpful assistant.<|EOT|><|BOT|>human\nSay it back."
        f"<audio_start>{'<audio_patch>' * patches}<audio_end><|EOT|><|BOT|>assistant\n<tts_start>"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert prompt == tokenizer(chat, add_special_tokens=False).input_ids
    engine.cancel("p")


def test_a_conversation_is_the_published_multi_turn_chat(published) -> None:
    """System, a user turn (text + clip), the assistant's answer (text), the last user turn (text + clip):
    the published chat string with each clip's placeholders, tokenized whole; each clip's placeholders
    name its own handle and rows 0..n-1 (both clips queued for the next step's encode)."""
    adapter, _, directory = published
    engine = adapter_engine(adapter, num_slots=2, max_seq_len=1024)
    first, last = tone_clip(CLIP_SAMPLES[0], seed=0), tone_clip(CLIP_SAMPLES[2], seed=2)
    history = (ChatTurn("user", "What is this?", first), ChatTurn("assistant", "It is a tone."))
    job = dataclasses.replace(engine.job("c", "And this?"), audio=last, system="Be brief.", history=history)
    engine.add_job(job)
    prompt = engine.requests["c"].prompt_ids
    patches = [num_placeholders(piece_log_mel(clip_wave_16k(clip)).shape[1]) for clip in (first, last)]
    chat = (
        "<|BOT|>system\nBe brief.<|EOT|>"
        f"<|BOT|>human\nWhat is this?<audio_start>{'<audio_patch>' * patches[0]}<audio_end><|EOT|>"
        "<|BOT|>assistant\nIt is a tone.<|EOT|>"
        f"<|BOT|>human\nAnd this?<audio_start>{'<audio_patch>' * patches[1]}<audio_end><|EOT|>"
        "<|BOT|>assistant\n<tts_start>"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert [t[0] for t in prompt] == tokenizer(chat, add_special_tokens=False).input_ids
    handles = adapter.clips.handles_of("c")
    assert len(handles) == 2 and adapter.num_pending_clips == 2
    for handle, num_patches in zip(handles, patches, strict=True):
        assert [t[2] for t in prompt if t[1] == handle] == list(range(num_patches))
    engine.cancel("c")
    assert adapter.clips.handles_of("c") == [] and adapter.num_pending_clips == 0  # not encoded yet: dropped


def test_a_conversation_longer_than_the_cache_is_refused_naming_messages(published) -> None:
    adapter = published[0]
    engine = adapter_engine(adapter, num_slots=2, max_seq_len=160)
    clip = tone_clip(CLIP_SAMPLES[1], seed=1)  # ~3 s: 39 placeholders a clip
    history = (ChatTurn("user", "", clip), ChatTurn("assistant", "Yes."), ChatTurn("user", "", clip))
    job = dataclasses.replace(engine.job("long", "And?"), audio=clip, history=history, text_field="messages")
    with pytest.raises(InvalidArgumentError) as err:
        engine.add_job(job)
    assert err.value.field == "messages" and "context holds 160" in err.value.message
    assert adapter.clips.handles_of("long") == [] and adapter.num_pending_clips == 0  # its queued clips went with it
    engine.add_job(dataclasses.replace(job, req_id="short", history=()))  # the last turn alone fits
    engine.cancel("short")


def independent_encode(model: StepAudio2LM, mel: torch.Tensor) -> torch.Tensor:
    """One piece alone, written with torch's MultiheadAttention and functional ops: mel [n_mels, T] -> [n, H]."""
    enc, adp, shape = model.encoder, model.adapter, model.encoder_shape
    frames = mel.shape[1]
    x = F.gelu(F.conv1d(mel[None], enc.conv1.weight, enc.conv1.bias, padding=1))
    x = F.gelu(F.conv1d(x, enc.conv2.weight, enc.conv2.bias, stride=2, padding=1))[0].T  # [T2, D]
    x = x + enc.positional_embedding.weight[: x.shape[0]]
    key_is_pad = ~(torch.arange((frames + 1) % 2, frames, 2) < frames - 2)[None]
    width = x.shape[1]
    for block in enc.blocks:
        mha = nn.MultiheadAttention(width, shape.n_audio_head, batch_first=True)
        a = block.attn
        mha.in_proj_weight.data = torch.cat([a.query.weight, a.key.weight, a.value.weight])
        mha.in_proj_bias.data = torch.cat([a.query.bias, torch.zeros(width), a.value.bias])
        mha.out_proj.weight.data, mha.out_proj.bias.data = a.out.weight, a.out.bias
        h = F.layer_norm(x, (width,), block.attn_ln.weight, block.attn_ln.bias)[None]
        x = x + mha(h, h, h, key_padding_mask=key_is_pad, need_weights=False)[0][0]
        h = F.layer_norm(x, (width,), block.mlp_ln.weight, block.mlp_ln.bias)
        x = x + block.mlp[2](F.gelu(block.mlp[0](h)))
    x = x[: x.shape[0] // 2 * 2].view(-1, 2, width).mean(1)
    x = F.layer_norm(x, (width,), enc.after_norm.weight, enc.after_norm.bias)
    x = F.gelu(F.conv1d(x.T[None], adp.conv.weight, adp.conv.bias, stride=shape.adapter_stride, padding=1))[0].T
    return adp.linear2(F.relu(adp.linear1(x)))[: num_placeholders(frames)]  # the published splice keeps these


def test_batched_encoder_equals_independent_solo_pieces(published) -> None:
    adapter = published[0]
    clips = [tone_clip(n, seed) for seed, n in enumerate(CLIP_SAMPLES)]
    for i, clip in enumerate(clips):
        adapter.queue_clip(f"enc{i}", clip_wave_16k(clip))
    handles = [adapter.clips.handles_of(f"enc{i}")[0] for i in range(len(clips))]
    mels = [mel for _, mel in adapter.clips.pending]
    adapter.prepare_step()  # one batched forward over the three pieces
    with torch.no_grad():
        for handle, mel in zip(handles, mels, strict=True):
            expected = independent_encode(adapter.model, mel)
            assert adapter.clips.rows[handle].shape == expected.shape == (num_placeholders(mel.shape[1]), 64)
            torch.testing.assert_close(adapter.clips.rows[handle], expected, atol=2e-5, rtol=1e-4)
    for i in range(len(clips)):
        adapter.forget(f"enc{i}")
    assert all(handle in adapter.clips.rows for handle in handles)  # encoded: kept for a clip sent again
    assert not any(adapter.clips.handles_of(f"enc{i}") for i in range(len(clips)))


def reference_greedy(model: StepAudio2LM, prompt: list[tuple[int, int, int]], rows: dict[int, torch.Tensor],
                     num_tokens: int, eot: int) -> list[int]:  # fmt: skip
    """transformers' Qwen2 on the same weights, the placeholders' embeddings replaced, full recompute per token."""
    qwen = Qwen2ForCausalLM(model.text_config).eval()
    qwen.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith(("model.", "lm_head."))})
    with torch.no_grad():
        embeds = qwen.model.embed_tokens(torch.tensor([[t[0] for t in prompt]]))
        for pos, (_, handle, row) in enumerate(prompt):
            if handle >= 0:
                embeds[0, pos] = rows[handle][row]
        tokens: list[int] = []
        for _ in range(num_tokens):
            token = int(qwen(inputs_embeds=embeds).logits[0, -1].argmax())
            if token == eot:
                break
            tokens.append(token)
            embeds = torch.cat([embeds, qwen.model.embed_tokens(torch.tensor([[token]]))], dim=1)
    return tokens


def test_greedy_tokens_equal_transformers_on_spliced_embeddings(published) -> None:
    adapter = published[0]
    engine = adapter_engine(adapter, num_slots=4, max_seq_len=1024)
    for i, n in enumerate(CLIP_SAMPLES):
        greedy = {"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 12}  # the reference has no penalty
        job = engine.job(f"g{i}", "Translate the speech.", sampling=greedy)
        engine.add_job(dataclasses.replace(job, audio=tone_clip(n, seed=i)))
    assert adapter.num_pending_clips == 3
    prompts = {rid: list(req.prompt_ids) for rid, req in engine.requests.items()}
    ours: dict[str, list[int]] = {}
    for out in engine.step():  # the three clips encoded in one forward, then the prompts prefilled
        ours.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert adapter.num_pending_clips == 0
    rows = {h: adapter.clips.rows[h].clone() for rid in prompts for h in adapter.clips.handles_of(rid)}
    with torch.no_grad():
        for handle, mel in zip(sorted(rows), [piece_log_mel(clip_wave_16k(tone_clip(n, i)))
                                              for i, n in enumerate(CLIP_SAMPLES)], strict=True):  # fmt: skip
            torch.testing.assert_close(rows[handle], independent_encode(adapter.model, mel), atol=2e-5, rtol=1e-4)
    for rid, tokens in engine.run_to_completion().items():
        ours.setdefault(rid, []).extend(tokens)
    assert not any(adapter.clips.handles_of(rid) for rid in prompts)  # every clip released with its request
    for rid, prompt in prompts.items():
        reference = reference_greedy(adapter.model, prompt, rows, 12, adapter.ids.eot)
        assert ours[rid] == reference and len(reference) == 12


def test_preset_builds_and_answers_audio() -> None:
    adapter = StepAudio2Adapter.build(ModelConfig(name="step-audio2-tiny", seed=0))
    engine = adapter_engine(adapter, num_slots=2, max_seq_len=1024)
    job = dataclasses.replace(engine.job("t", "hi", sampling={"temperature": 0.0, "max_tokens": 5}),
                              audio=tone_clip(4_000, seed=9))  # fmt: skip
    engine.add_job(job)
    assert len(engine.run_to_completion()["t"]) == 5


def speech_in_tokens(adapter: StepAudio2Adapter, graph_sizes: tuple[int, ...] = ()) -> dict[str, list[int]]:
    """Three clip requests (greedy and seeded), decoded eagerly or padded to `graph_sizes` as a captured
    decode graph runs them (off CUDA the padded batch runs eagerly)."""
    engine = adapter_engine(adapter, num_slots=4, max_seq_len=1024)
    runner = engine.runner
    if graph_sizes:
        runner.graphs = DecodeGraphs(runner._decode_forward, graph_sizes, runner.padding_row, runner.device)
    for i, n in enumerate(CLIP_SAMPLES):
        sampling = {"temperature": 0.0, "max_tokens": 14} if i % 2 else {"max_tokens": 14, "seed": i}
        engine.add_job(dataclasses.replace(engine.job(f"g{i}", "Answer.", sampling=sampling), audio=tone_clip(n, i)))
    return engine.run_to_completion()


def test_the_decode_forward_is_graph_ready_and_prompts_do_not_fold(published, monkeypatch) -> None:
    """Decode rows are sampled tokens, never audio placeholders: `decode_embed` takes their token embeddings
    with no op that waits for the device (`embed`'s placeholder branch does), so the decode forward replays as
    a CUDA graph; padded to the captured sizes it gives the eager tokens. Prompts (placeholders picked on the
    host) never fold into the decode forward."""
    monkeypatch.setattr(attention, "_capturing", lambda device: True)  # attention at the graph's static length
    adapter = published[0]
    eager = speech_in_tokens(adapter)
    assert speech_in_tokens(adapter, (2, 4)) == eager and all(len(t) == 14 for t in eager.values())

    engine = adapter_engine(adapter, num_slots=4, max_seq_len=1024)
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner._decode_forward, (4,), runner.padding_row, runner.device)
    for i, n in enumerate(CLIP_SAMPLES):
        engine.add_job(dataclasses.replace(engine.job(f"h{i}", "Answer.", sampling={"max_tokens": 30}),
                                           audio=tone_clip(n, i)))  # fmt: skip
    while engine.scheduler.waiting or any(r.num_cached < len(r.prompt_ids) for r in engine.requests.values()):
        engine.step()
    plan = engine.scheduler.schedule()
    assert len(plan.decodes) == 3 and not plan.prefills
    batch = runner.prepare(plan).decode
    with OpNames() as ops:
        runner.graphs.run_static(batch)
    assert not ops.host_waiting, ops.host_waiting
    with OpNames() as ops:
        adapter.embed(batch.input_ids)  # (the prompt path: which rows are placeholders is read on the host)
    assert ops.host_waiting
    assert not folds_prefill(adapter, torch.device("cuda")) and folds_prefill(orpheus_adapter(), torch.device("cuda"))

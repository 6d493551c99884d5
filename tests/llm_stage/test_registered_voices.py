"""Registered (zero-shot) voices on the LM side and in the flow detokenizer, without a cluster:
the LM prompt takes the voice's transcript and speech tokens, chunks carry the voice by handle,
and the codec conditions on the tensors it holds under that handle, exactly as if carried inline."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from core.voices import VoicePrompt, is_voice_id, voice_id_for
from detok_stage.codecs.s3gen_codec import CacheMissError
from detok_stage.voice.encoder import VoiceEncoder
from llm_stage.chunking import ChunkSchedule
from llm_stage.jobs import build_job
from llm_stage.models.cosyvoice2 import Kind
from llm_stage.models.orpheus import OrpheusAdapter
from llm_stage.side import LLMSide
from tests.detok_stage.test_s3gen_streaming import chunks_of, codec, tokens
from tests.factories import adapter_engine, cosyvoice2_adapter

VOICE_A = voice_id_for("cosyvoice2-tiny", b"clip a", 24_000, "")
VOICE_B = voice_id_for("cosyvoice2-tiny", b"clip b", 24_000, "")


def registered(voice_id: str, seed: int):
    """A voice as the VoiceBank computes it: our seeded encoders on a seeded clip."""
    clip = 0.1 * torch.randn(24_000 * 2, generator=torch.Generator().manual_seed(seed))
    return VoiceEncoder.seeded(seed).encode(clip, 24_000).with_id(voice_id)


def test_voice_ids_are_content_addressed():
    assert is_voice_id(VOICE_A) and VOICE_A == voice_id_for("cosyvoice2-tiny", b"clip a", 24_000, "")
    assert VOICE_A != VOICE_B != voice_id_for("cosyvoice2-tiny", b"clip a", 24_000, "its transcript")
    assert not is_voice_id("tara") and not is_voice_id("default") and not is_voice_id(None)


def test_jobs_take_voice_ids_only_for_families_with_zero_shot_voices():
    adapter = cosyvoice2_adapter()
    assert build_job(adapter, text="hi", voice=VOICE_A).voice == VOICE_A
    with pytest.raises(InvalidArgumentError) as err:
        build_job(adapter, text="hi", voice="tara")
    assert err.value.field == "voice"
    with pytest.raises(InvalidArgumentError) as err:
        build_job(OrpheusAdapter, text="hi", voice=VOICE_A)
    assert err.value.field == "voice" and "zero-shot" in err.value.message


def test_the_lm_prompt_takes_the_transcript_and_speech_tokens():
    adapter = cosyvoice2_adapter()
    adapter.add_voice_prompt(VoicePrompt(VOICE_A, "c", (5, 6)))
    adapter.add_voice_prompt(VoicePrompt(VOICE_B, "", (7, 8)))
    a, b, c = adapter.tokenizer.encode("abc")
    want = [(0, Kind.LLM), (c, Kind.PROMPT_TEXT), (a, Kind.TEXT), (b, Kind.TEXT), (1, Kind.LLM), (5, Kind.SPEECH)]
    assert adapter.format_prompt("ab", VOICE_A) == [*want, (6, Kind.SPEECH)]
    assert adapter.format_prompt("ab", VOICE_B) == adapter.format_prompt("ab", None)  # no transcript: flow only
    with pytest.raises(InvalidArgumentError) as err:
        adapter.format_prompt("ab", voice_id_for("x", b"", 1, ""))
    assert err.value.field == "voice"


def test_llm_side_stamps_the_voice_handle_on_every_chunk():
    adapter = cosyvoice2_adapter()
    adapter.add_voice_prompt(VoicePrompt(VOICE_A, "c", (5, 6)))
    side = LLMSide(adapter_engine(adapter), ChunkSchedule(4, 4, 100_000, 3))
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    side.add(dataclasses.replace(build_job(adapter, text="hello", voice=VOICE_A, sampling=greedy), req_id="a"))
    side.add(dataclasses.replace(build_job(adapter, text="hello", sampling=greedy), req_id="b"))
    chunks = []
    while side.engine.has_work:
        chunks += side.step()
    assert {c.req_id for c in chunks} == {"a", "b"} and any(c.is_final for c in chunks if c.req_id == "a")
    assert all(c.voice_handle == VOICE_A for c in chunks if c.req_id == "a")
    assert all(c.voice_handle is None for c in chunks if c.req_id == "b")
    assert not side.voice_handles  # forgotten once the stream ended


def decoded(chunks, handle: str | None):
    return torch.cat(codec().decode_stream([dataclasses.replace(c, voice_handle=handle) for c in chunks]))


def test_the_codec_conditions_on_the_voice_it_holds_by_handle():
    s3gen = codec()
    voice_a, voice_b = registered(VOICE_A, 1), registered(VOICE_B, 2)
    voice_a = dataclasses.replace(voice_a, prompt_tokens=voice_a.prompt_tokens % 64)  # the tiny flow's 64 ids
    voice_b = dataclasses.replace(voice_b, prompt_tokens=voice_b.prompt_tokens % 64)
    toks = tokens(30, 3)
    with pytest.raises(CacheMissError, match="not on this replica"):
        decoded(chunks_of("miss", toks, 4, 6), VOICE_A)
    s3gen.add_voice(voice_a)
    s3gen.add_voice(voice_b)
    by_handle = decoded(chunks_of("a1", toks, 4, 6), VOICE_A)
    inline = torch.cat(
        s3gen.decode_stream([dataclasses.replace(c, voice=voice_a) for c in chunks_of("a2", toks, 4, 6)])
    )
    again = decoded(chunks_of("a3", toks, 5, 9), VOICE_A)
    other = decoded(chunks_of("b", toks, 4, 6), VOICE_B)
    default = decoded(chunks_of("d", toks, 4, 6), None)
    assert torch.equal(by_handle, inline)
    assert float((by_handle - again).abs().max()) < 1e-4  # other chunk boundaries: the same audio
    assert float((by_handle - other).abs().max()) > 1e-2 and float((by_handle - default).abs().max()) > 1e-2

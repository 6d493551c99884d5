"""Qwen3-TTS tokenizer decoder streamed chunk by chunk (carried conv tails + windowed K/V) vs one
whole-utterance forward, a cold replica mid-stream, causality, and its sliding-window transformer
against transformers' Qwen3-Omni Code2Wav transformer (the same layers). Parity with the qwen-tts
package itself: tests/llm_stage/test_qwen3_tts_golden.py."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2WavTransformerModel

from core.config import DetokConfig, ModelConfig
from detok_stage.codecs.qwen3_tts_codec import Qwen3TTSCodec, tiny_tokenizer_config
from detok_stage.codecs.qwen3_tts_decoder import DecoderState
from detok_stage.engine import DetokEngine, pcm16_to_float
from llm_stage.chunking import Chunker, ChunkSchedule
from tests.detok_stage.interleaved import cut_with_resume, stream_interleaved


@functools.cache
def codec() -> Qwen3TTSCodec:
    return Qwen3TTSCodec.build(ModelConfig(name="qwen3-tts-tiny"))


def streams(lengths: list[int], seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(0, 64, (n, 4), generator=gen) for i, n in enumerate(lengths)}


def quantized(wave: torch.Tensor) -> torch.Tensor:
    return (wave.clamp(-1, 1) * 32767).round() / 32767


def test_preset_layout_is_the_published_rate_and_audible():
    c = codec()
    assert (c.codes_per_frame, c.codebook_size, c.samples_per_frame, c.sample_rate_hz) == (4, 64, 1920, 24000)
    audio = c.decode(streams([12])["r0"][None])
    assert audio.shape == (1, 12 * 1920) and 0.01 < float(audio.std()) < 0.5
    assert float((audio.abs() > 0.999).float().mean()) < 0.01


def test_streamed_equals_offline_on_every_sample():
    frames_by_req = streams([1, 7, 19, 33])  # past the tiny transformer's 8-frame window
    for config in (
        DetokConfig(first_chunk_frames=1, chunk_frames=4),
        DetokConfig(first_chunk_frames=3, chunk_frames=9),
    ):
        got = stream_interleaved(codec(), frames_by_req, config)
        for rid, frames in frames_by_req.items():
            offline = codec().decode(frames[None])[0]
            assert got[rid].shape == offline.shape
            torch.testing.assert_close(got[rid], quantized(offline), atol=4e-5, rtol=0)
    assert not codec()._streams  # final chunks drop their per-request state


def test_without_carried_state_streaming_is_not_exact():
    """Each chunk decoded from a fresh state (no left context) is audibly off: the carried state matters."""
    frames = streams([24])["r0"]
    chunks = Chunker("r", ChunkSchedule(2, 4, 0, 0)).push(frames.tolist())
    pieces = [codec().decode(torch.tensor(c.frames)[None])[0] for c in chunks]
    offline = codec().decode(frames[None])[0][: sum(p.shape[0] for p in pieces)]
    assert (torch.cat(pieces) - offline).abs().max() > 1e-2


def test_decoding_is_causal():
    frames = streams([20])["r0"]
    whole = codec().decode(frames[None])[0]
    torch.testing.assert_close(codec().decode(frames[None, :9])[0], whole[: 9 * 1920], atol=1e-5, rtol=0)


def test_chunks_arriving_out_of_order_decode_in_seq_order():
    """The detok deployment's engine (in_order=False, priority order) receives a stream's chunks
    from concurrent decode calls, later ones first: each waits for its predecessor, so the carried
    state stays exact (decoding one early restarted the state: audible drift mid-stream)."""
    frames_by_req = streams([19, 26])
    engine = DetokEngine(codec(), DetokConfig(), in_order=False)
    chunks = {}
    for rid, frames in frames_by_req.items():
        chunker = Chunker(rid, ChunkSchedule(2, 4, 3, 0))
        chunks[rid] = chunker.push(frames.tolist()) + chunker.finish()
    pcm: dict[str, dict[int, bytes]] = {rid: {} for rid in frames_by_req}

    def decode_ready() -> None:
        while engine.has_work:
            for out in engine.step():
                pcm[out.req_id][out.seq] = out.pcm16

    for cs in chunks.values():
        engine.submit(cs[0])
    decode_ready()
    for chunk in sorted((c for cs in chunks.values() for c in cs[2:]), key=lambda c: -c.seq):
        engine.submit(chunk)  # later chunks first: none can be decoded before its predecessor
        assert not engine.has_work
    for cs in chunks.values():
        engine.submit(cs[1])
        decode_ready()
        assert len(pcm[cs[1].req_id]) == len(cs)  # its missing link came: the whole stream decoded
    assert not engine.num_queued and not codec()._streams
    for rid, frames in frames_by_req.items():
        got = torch.from_numpy(pcm16_to_float(b"".join(pcm[rid][seq] for seq in sorted(pcm[rid]))))
        torch.testing.assert_close(got, quantized(codec().decode(frames[None])[0]), atol=4e-5, rtol=0)


def test_cold_replica_mid_stream_rebuilds_state_from_left_context():
    frames = streams([20])["r0"]
    chunks = Chunker("r", ChunkSchedule(2, 4, 3, 0)).push(frames.tolist())
    warm = Qwen3TTSCodec(codec().decoder, 24000).decode_stream(chunks)
    cold = Qwen3TTSCodec(codec().decoder, 24000).decode_stream(chunks[:1])
    cold += Qwen3TTSCodec(codec().decoder, 24000).decode_stream(chunks[1:])
    assert [a.shape for a in cold] == [a.shape for a in warm]
    torch.testing.assert_close(cold[0], warm[0])
    assert (cold[1] - warm[1]).abs().max() < 0.5  # approximate: 3 frames of context, not the whole past


def test_transformer_matches_transformers_qwen3_omni_code2wav_transformer():
    fields = tiny_tokenizer_config()["decoder_config"]
    omni = Qwen3OmniMoeCode2WavTransformerModel(Qwen3OmniMoeCode2WavConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        sliding_window=fields["sliding_window"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )).eval()  # fmt: skip
    ours = copy.deepcopy(codec().decoder.pre_transformer)
    omni.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith(("input_", "output_"))})
    with torch.no_grad():
        for p in omni.parameters():  # wider than the layer scale's 0.01, so attention matters
            if p.dim() == 1 and p.shape[0] == 32:
                p.uniform_(0.5, 1.5)
        ours.load_state_dict({**ours.state_dict(), **omni.state_dict()})
        x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(0))
        want = ours.output_proj(omni(inputs_embeds=ours.input_proj(x)).last_hidden_state)
        torch.testing.assert_close(ours(x, DecoderState()), want, atol=1e-5, rtol=1e-4)
        state = DecoderState()  # and in pieces, through the carried window
        pieces = torch.cat([ours(x[:, :5], state), ours(x[:, 5:6], state), ours(x[:, 6:], state)], dim=1)
        torch.testing.assert_close(pieces, want, atol=1e-5, rtol=1e-4)


def test_a_chunk_sent_again_after_an_llm_resume_decodes_exactly():
    """A chunk this replica decoded but the router never got (its LLM replica died first) comes again
    from the replica that resumed the stream, maybe cut longer or shorter: it decodes from the state
    before it, as the stream's offline decode does, not from a state rebuilt from its left context."""
    frames = streams([24])["r0"]
    offline = quantized(codec().decode(frames[None])[0])
    first, resent = cut_with_resume(frames, right_context=0)
    decoder = Qwen3TTSCodec(codec().decoder, 24000)
    sent = decoder.decode_stream(first[:4])  # chunks 2 and 3 decoded; the router never got them
    audio = torch.cat([*sent[:2], *decoder.decode_stream(resent)])
    per_frame = codec().samples_per_frame
    torch.testing.assert_close(quantized(audio), offline, atol=4e-5, rtol=0)
    assert audio.shape[0] == frames.shape[0] * per_frame and not decoder._streams


@pytest.mark.parametrize("call_in_flight", [True, False])
def test_the_detok_engine_takes_a_resumed_streams_chunks_again(call_in_flight: bool):
    """The lost LLM replica's decode call, if one was in flight, is cancelled (its queued chunks
    dropped, the decoder state kept: `drop_queued`); the resumed stream sends chunks from an
    earlier seq than this engine decoded: they decode (not held for a predecessor), from the kept
    state, as offline decoding."""
    frames = streams([24])["r0"]
    first, resent = cut_with_resume(frames, right_context=0)
    engine = DetokEngine(Qwen3TTSCodec(codec().decoder, 24000), DetokConfig(), in_order=False)
    audio: dict[int, bytes] = {}
    for chunk in first[:4]:  # chunks 2 and 3 decoded, never received by the router
        engine.submit(chunk)
        audio |= {out.seq: out.pcm16 for out in engine.step()}
    if call_in_flight:
        engine.submit(first[4])
        engine.drop_queued("r")  # the call carrying chunk 4 cancelled with its LLM replica
    audio = {seq: pcm for seq, pcm in audio.items() if seq < 2}
    for chunk in resent:
        engine.submit(chunk)
        while engine.has_work:
            audio |= {out.seq: out.pcm16 for out in engine.step()}
    got = torch.from_numpy(pcm16_to_float(b"".join(audio[seq] for seq in sorted(audio))))
    torch.testing.assert_close(got, quantized(codec().decode(frames[None])[0]), atol=4e-5, rtol=0)


@pytest.mark.parametrize("in_order", [False, True])
def test_a_chunk_redone_for_the_router_leaves_the_stream_decoding_as_it_was(in_order: bool):
    """The Router lost a chunk's audio (`RouterCore._fetch`) while the stream goes on: the chunk is decoded again on
    a replica that already decoded the chunks after it (`TokenChunk.redo`). It decodes on its own, to the audio the
    stream had; the stream's next chunks decode at once, from its own state, as offline decoding (before, the redo
    rewound the stream's decode order as a resumed stream's resend does, and its next chunk waited for ever)."""
    frames = streams([24])["r0"]
    chunker = Chunker("r", ChunkSchedule(2, 4, 3, 0))
    chunks = chunker.push(frames.tolist()) + chunker.finish()
    engine = DetokEngine(Qwen3TTSCodec(codec().decoder, 24000), DetokConfig(), in_order=in_order)
    audio: dict[int, bytes] = {}
    for chunk in chunks[:4]:
        engine.submit(chunk)
        audio |= {out.seq: out.pcm16 for out in engine.step()}
    engine.submit(dataclasses.replace(chunks[1], redo=True))
    [redone] = engine.step()
    assert (redone.req_id, redone.seq) == ("r", 1)
    torch.testing.assert_close(torch.from_numpy(pcm16_to_float(redone.pcm16)),
                               torch.from_numpy(pcm16_to_float(audio[1])), atol=4e-5, rtol=0)  # fmt: skip
    for chunk in chunks[4:]:
        engine.submit(chunk)
        assert engine.has_work  # not held for a predecessor
        audio |= {out.seq: out.pcm16 for out in engine.step()}
    got = torch.from_numpy(pcm16_to_float(b"".join(audio[seq] for seq in sorted(audio))))
    torch.testing.assert_close(got, quantized(codec().decode(frames[None])[0]), atol=4e-5, rtol=0)
    assert not engine._redos and not engine.codec._streams  # the redo left no state behind (nor did the stream)

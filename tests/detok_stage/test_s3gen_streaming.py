"""The S3Gen flow-matching detokenizer streamed with per-request caches: exact against offline
decoding, batched across requests, rebuilt on a cache miss, configurable Euler steps."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from core.config import DetokConfig, ModelConfig
from core.messages import TokenChunk, VoiceConditioning
from detok_stage.codecs.s3gen_codec import CacheMissError, S3GenCodec
from detok_stage.engine import DetokEngine, pcm16_to_float
from detok_stage.flow.config import full_s3gen_config, tiny_s3gen_config
from detok_stage.flow.flow import Conditioning
from detok_stage.flow.model import S3Gen
from llm_stage.chunking import Chunker, ChunkSchedule
from tests.detok_stage.interleaved import stream_interleaved

WHOLE_HISTORY = 100_000  # left context: every chunk carries the stream from token 0 (cache-miss rebuild)


@functools.cache
def codec() -> S3GenCodec:
    return S3GenCodec.build(ModelConfig(name="s3gen-tiny", seed=5), preset=tiny_s3gen_config())


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def chunks_of(rid: str, toks: torch.Tensor, first: int, size: int) -> list[TokenChunk]:
    chunker = Chunker(rid, ChunkSchedule(first, size, WHOLE_HISTORY, 3))
    return chunker.push([[int(t)] for t in toks]) + chunker.finish()


def with_voice(chunks: list[TokenChunk], voice: VoiceConditioning | None) -> list[TokenChunk]:
    return [dataclasses.replace(c, voice=voice) for c in chunks]


def voice(seed: int = 9, prompt: int = 6) -> VoiceConditioning:
    gen = torch.Generator().manual_seed(seed)
    return VoiceConditioning(
        f"v{seed}", torch.randint(0, 64, (prompt,), generator=gen), torch.randn(2 * prompt, 80, generator=gen),
        torch.randn(192, generator=gen),
    )  # fmt: skip


def offline(toks: torch.Tensor, v: VoiceConditioning | None = None, c: S3GenCodec | None = None) -> torch.Tensor:
    return (c or codec()).decode(toks.view(1, -1, 1), v)[0]


@pytest.mark.parametrize("n, first, size", [(1, 1, 4), (11, 2, 5), (29, 3, 7), (40, 8, 8)])
def test_streamed_equals_offline(n, first, size):
    toks = tokens(n, n)
    audio = codec().decode_stream(chunks_of("r", toks, first, size))
    streamed = torch.cat(audio)
    want = offline(toks)
    assert streamed.shape == want.shape == (n * 960,)
    diff = float((streamed - want).abs().max())
    print(f"n={n} first={first} size={size}: streamed vs offline max abs diff {diff:.2e}")
    assert diff < 1e-4
    assert not codec()._states  # the final chunk dropped the request's caches


@functools.cache
def bounded_codec(sink: int, window: int) -> S3GenCodec:
    """`codec()`'s weights, its estimator reading `sink` + `window` frames of history."""
    bounded = S3GenCodec.build(ModelConfig(name="s3gen-tiny", seed=5), preset=tiny_s3gen_config())
    bounded.bound_flow_history(sink, window)
    return bounded


@pytest.mark.parametrize("sink, window", [(0, 8), (6, 12), (4, 1000)])
def test_a_bounded_history_streams_what_offline_decoding_gives(sink, window):
    """A bounded estimator history (tiny chunk: 8 frames) streams the audio offline decoding gives under
    the same mask, with a prompted voice in the sink; it differs from the exact audio unless the window
    covers the whole stream."""
    toks, v = tokens(37, 11), voice(5)
    c = bounded_codec(sink, window)
    streamed = torch.cat(c.decode_stream(with_voice(chunks_of("r", toks, 2, 6), v)))
    want = offline(toks, v, c)
    assert float((streamed - want).abs().max()) < 1e-4
    change = float((want - offline(toks, v)).abs().max())
    assert change < 1e-4 if window >= 2 * (37 + 6) else change > 1e-3


def test_a_prompted_voice_streams_exactly_and_changes_the_audio():
    toks, v = tokens(23, 4), voice()
    streamed = torch.cat(codec().decode_stream(with_voice(chunks_of("r", toks, 2, 6), v)))
    want = offline(toks, v)
    assert float((streamed - want).abs().max()) < 1e-4
    assert float((want - offline(toks)).abs().max()) > 1e-2  # the voice reaches the decoder


def test_eight_requests_batched_with_different_boundaries_equal_each_alone():
    frames = {f"r{i}": tokens(9 + 4 * i, 100 + i) for i in range(8)}
    configs = [DetokConfig(first_chunk_frames=1 + i % 3, chunk_frames=3 + i, left_context_frames=WHOLE_HISTORY,
                           right_context_frames=3, adaptive=False) for i in range(8)]  # fmt: skip
    # one engine, per-request chunkers with their own boundaries
    engine = DetokEngine(codec(), DetokConfig(max_batch_chunks=64))
    chunkers = {rid: Chunker(rid, ChunkSchedule.from_config(cfg)) for rid, cfg in zip(frames, configs, strict=True)}
    pcm: dict[str, list[bytes]] = {rid: [] for rid in frames}
    calls = []
    original = codec().model.flow.advance

    def counting(states, length):
        calls.append(len(states))
        return original(states, length)

    codec().model.flow.advance = counting
    try:
        for t in range(max(len(f) for f in frames.values())):
            for rid, toks in frames.items():
                if t < len(toks):
                    for chunk in chunkers[rid].push([[int(toks[t])]]) + (
                        chunkers[rid].finish() if t == len(toks) - 1 else []
                    ):
                        engine.submit(chunk)
            if t % 4 == 3:
                for out in engine.step():
                    pcm[out.req_id].append(out.pcm16)
        while engine.has_work:
            for out in engine.step():
                pcm[out.req_id].append(out.pcm16)
    finally:
        del codec().model.flow.advance
    assert max(calls) > 1  # requests really shared forwards
    for rid, toks in frames.items():
        got = torch.from_numpy(pcm16_to_float(b"".join(pcm[rid])))
        want = offline(toks).clamp(-1, 1)
        torch.testing.assert_close(got, (want * 32767).round() / 32767, atol=2e-4, rtol=0)


def test_engine_interleaved_streams_equal_offline():
    frames = {f"r{i}": tokens(n, 200 + i).view(-1, 1) for i, n in enumerate([2, 13, 27])}
    cfg = DetokConfig(first_chunk_frames=2, chunk_frames=8, left_context_frames=WHOLE_HISTORY, right_context_frames=3)
    got = stream_interleaved(codec(), frames, cfg)
    for rid, f in frames.items():
        want = offline(f[:, 0]).clamp(-1, 1)
        torch.testing.assert_close(got[rid], (want * 32767).round() / 32767, atol=2e-4, rtol=0)


def test_cache_miss_rebuild_equals_cache_hit():
    toks, v = tokens(31, 7), voice(3)
    chunks = with_voice(chunks_of("r", toks, 3, 6), v)
    warm = S3GenCodec(codec().model)
    warm_audio = warm.decode_stream(chunks)
    for cut in (1, 3):  # the replica holding the request dies before chunk `cut`
        cold = S3GenCodec(codec().model)
        cold_audio = S3GenCodec(codec().model).decode_stream(chunks[:cut]) + cold.decode_stream(chunks[cut:])
        assert cold.num_rebuilds == 1
        assert [a.shape for a in cold_audio] == [a.shape for a in warm_audio]
        for a, b in zip(cold_audio, warm_audio, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_cache_miss_without_history_is_refused():
    toks = tokens(20, 8)
    chunker = Chunker("r", ChunkSchedule(4, 4, 2, 3))  # only 2 tokens of left context
    chunks = chunker.push([[int(t)] for t in toks]) + chunker.finish()
    with pytest.raises(CacheMissError, match="history starts at token"):
        S3GenCodec(codec().model).decode_stream(chunks[2:])


def test_euler_steps_are_configurable():
    toks = tokens(12, 9)
    waves = {}
    for steps in (10, 5, 2):
        c = S3GenCodec(codec().model, n_timesteps=steps)
        streamed = torch.cat(c.decode_stream(chunks_of("r", toks, 2, 4)))
        torch.testing.assert_close(streamed, offline(toks, c=c), atol=1e-4, rtol=0)
        assert c.model.flow.new_state(c.default_voice, steps).n_timesteps == steps
        waves[steps] = streamed
    assert float((waves[10] - waves[2]).abs().max()) > 1e-3


def test_cache_grows_with_the_stream_and_release_drops_it():
    c = S3GenCodec(codec().model)
    chunks = chunks_of("r", tokens(30, 10), 4, 8)
    c.decode_stream(chunks[:1])
    first = c.cache_bytes("r")
    c.decode_stream(chunks[1:3])
    assert c.cache_bytes("r") > first > 0
    c.release("r")
    assert c.cache_bytes("r") == 0


def test_full_size_shapes_build():
    model = S3Gen(full_s3gen_config())
    flow = sum(p.numel() for p in model.flow.parameters())
    hift = sum(p.numel() for p in model.mel2wav.parameters())
    assert 90e6 < flow < 130e6 and 15e6 < hift < 25e6, (flow, hift)


@pytest.mark.parametrize("layout", ["cosyvoice2", "chatterbox"])
def test_published_layouts_load(tmp_path, layout):
    """flow.pt + hift.pt (CosyVoice2-0.5B) and s3gen.pt with flow.* / mel2wav.* (chatterbox) load by name."""
    model = codec().model
    if layout == "cosyvoice2":
        torch.save(model.flow.state_dict(), tmp_path / "flow.pt")
        torch.save(model.mel2wav.state_dict(), tmp_path / "hift.pt")
    else:
        state = {**model.state_dict(), "tokenizer._mel_filters": torch.zeros(2), "speaker_encoder.x": torch.zeros(1)}
        torch.save(state, tmp_path / "s3gen.pt")
    loaded = S3GenCodec.build(ModelConfig(name="cosyvoice2", checkpoint_dir=tmp_path), preset=tiny_s3gen_config())
    toks = tokens(6, 1)
    torch.testing.assert_close(offline(toks, c=loaded), offline(toks))


def test_a_prompt_mel_not_twice_the_prompt_tokens_is_cut_to_fit():
    cond = Conditioning(torch.arange(5), torch.zeros(7, 80), torch.zeros(192))
    assert cond.prompt_tokens.tolist() == [0, 1, 2] and cond.prompt_mel.shape == (6, 80)

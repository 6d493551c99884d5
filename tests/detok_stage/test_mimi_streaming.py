"""Mimi streamed chunk by chunk (carried transformer KV + conv context) vs offline decoding,
and csm-tiny end to end."""

from __future__ import annotations

import functools

import torch

from cluster.pipeline import InProcessPipeline
from core.config import CacheConfig, DetokConfig, EngineConfig, ModelConfig, SchedulerConfig
from detok_stage.codecs.mimi_codec import MimiCodec, load_mimi, tiny_mimi_config
from llm_stage.chunking import Chunker, ChunkSchedule
from tests.detok_stage.interleaved import cut_with_resume, stream_interleaved

LONG_WINDOW = {**tiny_mimi_config(8), "sliding_window": 32}  # transformer steps: past a chunk's left context


@functools.cache
def codec() -> MimiCodec:
    return MimiCodec.build(ModelConfig(name="csm-tiny"))


def streams(lengths: list[int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"r{i}": torch.randint(0, 64, (n, 8), generator=gen) for i, n in enumerate(lengths)}


def test_streamed_equals_offline_on_kept_samples():
    frames_by_req = streams([1, 7, 19, 33])
    got = stream_interleaved(codec(), frames_by_req, DetokConfig(first_chunk_frames=1, chunk_frames=4))
    spf = codec().samples_per_frame
    for rid, frames in frames_by_req.items():
        offline = codec().decode(frames.unsqueeze(0))[0].clamp(-1, 1)
        assert got[rid].shape[0] == len(frames) * spf
        torch.testing.assert_close(got[rid], (offline * 32767).round() / 32767, atol=1e-4, rtol=0)
    assert not codec()._states  # final chunks drop their per-request caches


def test_the_preset_decodes_each_code_its_own_way():
    """csm-tiny's Mimi has random codebooks (transformers builds zeros): a code changed in any
    codebook changes the audio; the same seed builds the same weights."""
    frames = streams([6])["r0"].unsqueeze(0)  # [1, n, K]
    audio = codec().decode(frames)
    for k in (0, 7):  # the semantic codebook, the last acoustic one
        other = frames.clone()
        other[0, 3, k] = (other[0, 3, k] + 1) % 64
        assert (codec().decode(other) - audio).abs().max() > 1e-2, k
    again = load_mimi(None, ModelConfig(name="csm-tiny").seed, tiny_mimi_config(8))
    for (name, mine), theirs in zip(codec().model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name


def test_the_codec_drops_centroids_cached_before_it_moved_the_model():
    """A codebook caches its centroids outside its buffers on first use, so a Mimi used before the
    codec moved it (CSM's encoder shares it) would keep them on the old device."""
    model = load_mimi(None, ModelConfig(name="csm-tiny").seed, tiny_mimi_config(8))
    model.decode(streams([2])["r0"].T.unsqueeze(0))  # first use: centroids cached
    cached = [m for m in model.modules() if getattr(m, "_embed", None) is not None]
    assert cached
    MimiCodec(model, device="cpu")
    assert all(m._embed is None for m in cached)


def test_without_conv_context_streaming_is_not_exact():
    """The SEANet left context is what makes chunk seams exact (guards the test above)."""
    frames = streams([24])["r0"]
    mimi = MimiCodec(codec().model, conv_context_steps=0)
    chunker = Chunker("r", ChunkSchedule(2, 4, 3, 3))
    audio = torch.cat(mimi.decode_stream(chunker.push(frames.tolist()) + chunker.finish()))
    assert (audio - codec().decode(frames.unsqueeze(0))[0]).abs().max() > 1e-3


def test_cold_replica_mid_stream_rebuilds_state_from_left_context():
    frames = streams([20])["r0"]
    chunker = Chunker("r", ChunkSchedule(2, 4, 3, 3))
    chunks = chunker.push(frames.tolist()) + chunker.finish()
    warm = MimiCodec(codec().model)
    cold = MimiCodec(codec().model)
    warm_audio = warm.decode_stream(chunks)
    cold_audio = cold.decode_stream(chunks[:1]) + MimiCodec(codec().model).decode_stream(chunks[1:])
    assert [a.shape for a in cold_audio] == [a.shape for a in warm_audio]
    torch.testing.assert_close(cold_audio[0], warm_audio[0])


def test_csm_tiny_synthesizes_end_to_end():
    config = EngineConfig(
        model=ModelConfig(name="csm-tiny"), cache=CacheConfig(num_slots=2, max_seq_len=128),
        scheduler=SchedulerConfig(max_batch_size=2),
    )  # fmt: skip
    pipeline = InProcessPipeline(config)
    pcm = pipeline.synthesize("hello", "0", {"max_tokens": 10, "seed": 1})
    assert 0 < len(pcm) <= 10 * codec().samples_per_frame * 2 and len(pcm) % (codec().samples_per_frame * 2) == 0


def test_a_chunk_sent_again_after_an_llm_resume_decodes_exactly():
    """A chunk decoded here that the router never got (its LLM replica died first) comes again from
    the replica that resumed the stream, maybe cut differently: it decodes from the state before it
    (the audio an uninterrupted stream has), not from one rebuilt on its left context."""
    model = MimiCodec.build(ModelConfig(name="csm-tiny"), preset=LONG_WINDOW).model  # (random codebooks: a
    # state rebuilt on the left context decodes other audio, `test_the_preset_decodes_each_code_its_own_way`)
    frames = streams([30])["r0"]
    first, resent = cut_with_resume(frames, right_context=3)
    uninterrupted = torch.cat(MimiCodec(model).decode_stream(first))
    mimi = MimiCodec(model)
    sent = mimi.decode_stream(first[:4])  # chunks 2 and 3 decoded; the router never got them
    audio = torch.cat([*sent[:2], *mimi.decode_stream(resent)])
    torch.testing.assert_close(audio, uninterrupted, atol=1e-5, rtol=0)
    assert not mimi._states

"""DAC detokenizer: measured receptive field, streamed (windows with context) == offline decoding,
and dia-tiny end to end in-process with CFG on."""

from __future__ import annotations

import functools

import torch

from cluster.pipeline import InProcessPipeline
from core.config import CacheConfig, DetokConfig, EngineConfig, ModelConfig, SchedulerConfig
from detok_stage.codecs.dac_codec import RECEPTIVE_FIELD_FRAMES, DacCodec
from detok_stage.engine import DetokEngine, pcm16_to_float
from llm_stage.chunking import Chunker, ChunkSchedule

RF = RECEPTIVE_FIELD_FRAMES
HOP = 512


@functools.cache
def codec() -> DacCodec:
    return DacCodec.build(ModelConfig(name="dia-tiny"))


def random_frames(num_frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (num_frames, 4), generator=torch.Generator().manual_seed(seed))


def test_receptive_field_is_nine_frames_each_side():
    """Change one frame: exactly the frames within RF of it change (DAC is non-causal)."""
    frames, at = random_frames(2 * RF + 12, 1), RF + 6
    changed = frames.clone()
    changed[at] = (changed[at] + 7) % 64
    diff = (codec().decode(frames[None]) - codec().decode(changed[None]))[0].abs().view(-1, HOP).amax(dim=1)
    touched = torch.nonzero(diff > 0).flatten()
    assert (at - int(touched.min()), int(touched.max()) - at) == (RF, RF)
    assert codec().decode(frames[None]).abs().max() > 0.05  # the preset decodes to audible levels


def streamed(frames: torch.Tensor, config: DetokConfig, push: int = 3) -> torch.Tensor:
    engine, chunker = DetokEngine(codec(), config), Chunker("r", ChunkSchedule.from_config(config))
    pcm = []
    for start in range(0, len(frames), push):
        for chunk in chunker.push(frames[start : start + push].tolist()):
            engine.submit(chunk)
        pcm += [out.pcm16 for out in engine.step()]
    for chunk in chunker.finish():
        engine.submit(chunk)
    while engine.has_work:
        pcm += [out.pcm16 for out in engine.step()]
    return torch.from_numpy(pcm16_to_float(b"".join(pcm)))


def test_streamed_equals_offline_with_receptive_field_context():
    config = DetokConfig(first_chunk_frames=2, chunk_frames=8, left_context_frames=RF, right_context_frames=RF)
    no_context = DetokConfig(first_chunk_frames=2, chunk_frames=8, left_context_frames=0, right_context_frames=0)
    for seed, num_frames in enumerate([1, 13, 37]):
        frames = random_frames(num_frames, seed)
        offline = (codec().decode(frames[None])[0].clamp(-1, 1) * 32767).round() / 32767
        got = streamed(frames, config)
        assert got.shape[0] == num_frames * HOP
        torch.testing.assert_close(got, offline, atol=1.5 / 32767, rtol=0)  # within one PCM16 step
        if num_frames > 8:  # chunk seams without context are audible: the context is needed
            assert (streamed(frames, no_context) - offline).abs().max() > 1e-2


def test_dia_tiny_synthesizes_with_cfg():
    config = EngineConfig(
        model=ModelConfig(name="dia-tiny"), cache=CacheConfig(num_slots=4, max_seq_len=128),
        scheduler=SchedulerConfig(max_batch_size=4), detok=DetokConfig(left_context_frames=RF, right_context_frames=RF),
    )  # fmt: skip
    pipeline = InProcessPipeline(config)
    pcm = pipeline.synthesize("[S1] hello there", None, {"max_tokens": 30, "guidance_scale": 3.0, "seed": 1})
    assert len(pcm) % (HOP * 2) == 0 and 0 < len(pcm) <= (30 - 6) * HOP * 2  # frames before the EOS cascade
    assert pipeline.llm.engine.scheduler.slots.num_free == 4

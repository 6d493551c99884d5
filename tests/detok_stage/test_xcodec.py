"""X-Codec detokenizer and the parallel-heads-tiny model end to end in-process (CFG on)."""

from __future__ import annotations

import functools

import torch

from cluster.pipeline import InProcessPipeline
from core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from detok_stage.codecs.xcodec_codec import XcodecCodec


@functools.cache
def codec() -> XcodecCodec:
    return XcodecCodec.build(ModelConfig(name="parallel-heads-tiny"))


def test_xcodec_frame_layout_and_batched_decode_matches_single():
    assert (codec().codes_per_frame, codec().samples_per_frame, codec().sample_rate_hz) == (8, 320, 16000)
    frames = torch.randint(0, 1024, (3, 6, 8), generator=torch.Generator().manual_seed(1))
    batched = codec().decode(frames)
    assert batched.shape == (3, 6 * 320)
    torch.testing.assert_close(batched[1], codec().decode(frames[1:2])[0], atol=1e-5, rtol=0)


def test_parallel_heads_tiny_synthesizes_with_cfg():
    config = EngineConfig(
        model=ModelConfig(name="parallel-heads-tiny"), cache=CacheConfig(num_slots=4, max_seq_len=256),
        scheduler=SchedulerConfig(max_batch_size=4),
    )  # fmt: skip
    pipeline = InProcessPipeline(config)
    pcm = pipeline.synthesize("hello", None, {"max_tokens": 30, "guidance_scale": 3.0, "seed": 1})
    assert len(pcm) == (30 - 8) * 320 * 2  # frames before the EOS cascade, 16-bit samples
    assert pipeline.llm.engine.scheduler.slots.num_free == 4

"""Per-chunk hop times from the stages' stamps (loadtest.metrics)."""

import dataclasses

from cluster.pipeline import InProcessPipeline
from core.config import CacheConfig, EngineConfig, ModelConfig
from core.messages import HopTimes
from loadtest.metrics import HOPS, RequestRecord, chunk_hops_s, hop_breakdown


def test_chunk_hops_are_the_gaps_between_stamps():
    hops = chunk_hops_s((10.0, 10.25, 10.5, 11.0), 12.0)
    assert hops == [0.25, 0.25, 0.5, 1.0]
    assert len(hops) == len(HOPS)


def test_unstamped_chunk_has_no_hops():
    assert chunk_hops_s((10.0, 0.0, 10.5, 11.0), 12.0) is None


def test_breakdown_percentiles_per_hop():
    records = [RequestRecord(hops_s=[[0.001 * i, 0.002 * i, 0.0, 0.0] for i in range(1, 11)])]
    breakdown = hop_breakdown(records)
    assert list(breakdown) == list(HOPS)
    assert breakdown[HOPS[1]]["p90_ms"] > breakdown[HOPS[0]]["p90_ms"] > 0


def test_stages_stamp_hops_in_order():
    config = EngineConfig(model=ModelConfig(name="orpheus-tiny"), cache=CacheConfig(num_slots=64, max_seq_len=256))
    pipeline = InProcessPipeline(config)
    try:
        pipeline.submit("r", "hello there", None, {"max_tokens": 56, "seed": 0})
        chunks = list(pipeline.stream())
    finally:
        pipeline.close()
    assert chunks
    for chunk in chunks:
        hops = chunk.hops
        assert 0 < hops.chunk_ready_unix_s <= hops.detok_received_unix_s <= hops.audio_ready_unix_s
        assert dataclasses.replace(hops) == hops and isinstance(hops, HopTimes)

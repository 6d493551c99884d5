"""loadtest/two_gpu_estimate.py: the sizes it prices come from the real messages, the config and the
H200 bench's JSON; transfer times follow each link's stated bandwidth and latency."""

from __future__ import annotations

import json

from core.config import DetokConfig
from loadtest import two_gpu_estimate as est


def test_sizes_come_from_the_config_the_messages_and_the_bench():
    report = est.main(["--rates", "20", "40"])
    stream = report["stream"]
    assert stream["kv_bytes_per_token"] == 28 * 2 * 8 * 128 * 2  # Llama-3.2-3B: layers x K,V x kv heads x dim x bf16
    assert stream["frames"] == 85 and stream["chunks"] == 1 + 11  # 2 frames first, then chunks of 8 (gpu.yaml)
    assert stream["audio_chunk_bytes"] == 8 * 2048 * 2  # 8 SNAC frames of PCM16
    assert 14 * 7 * 2 < stream["token_chunk_bytes"] < 14 * 7 * 12  # 14 window frames of 7 codes, pickled
    assert stream["kv_bytes_mid_stream"] < stream["kv_bytes_at_end"] == stream["kv_bytes_per_token"] * (40 + 7 * 85)
    assert report["measured_one_gpu"]["llm_step_ms_128_rows"] > 0 and len(report["links"]) == len(est.LINKS)


def test_a_wider_window_pickles_bigger_and_a_faster_link_moves_it_sooner():
    narrow = DetokConfig(first_chunk_frames=2, chunk_frames=8, left_context_frames=3, right_context_frames=3)
    wide = DetokConfig(first_chunk_frames=2, chunk_frames=16, left_context_frames=3, right_context_frames=3)
    assert est.token_chunk_bytes(wide) > est.token_chunk_bytes(narrow)
    assert est.chunk_count(85, wide) < est.chunk_count(85, narrow)
    nvlink, pcie4 = est.LINKS[0], est.LINKS[2]
    assert nvlink.transfer_ms(40_000_000) < pcie4.transfer_ms(40_000_000)
    assert pcie4.transfer_ms(0) == pcie4.latency_us / 1e3  # an empty transfer costs the latency floor only


def test_the_report_is_written_as_json(tmp_path):
    out = tmp_path / "estimate.json"
    report = est.main(["--rates", "10", "--out", str(out)])
    assert json.loads(out.read_text())["links"] == json.loads(json.dumps(report["links"]))
    assert all("chunk_traffic_pct_at_10_rps" in row for row in report["links"])

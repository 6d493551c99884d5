"""cluster_bench's admit-all config and its report (pure: no Ray)."""

from __future__ import annotations

from core.config import load_serve_config
from loadtest.cluster_bench import admit_all_config, report
from loadtest.serve_voxray import CPU_CONFIG
from loadtest.sweep import SweepConfig


def test_the_admit_all_config_admits_what_the_kv_cache_holds_and_queues_the_rest(tmp_path):
    path = admit_all_config(CPU_CONFIG, tmp_path, max_requests=60)
    config, base = load_serve_config(path, check_files=False), load_serve_config(CPU_CONFIG, check_files=False)
    assert config.admission.policy == "fixed_cap"
    assert config.admission.max_streams_per_replica == base.engine.cache.num_slots
    assert config.admission.max_queued_per_replica == 60
    assert config.engine == base.engine and config.llm == base.llm  # only admission differs


def _step(rate: float, audio_x: float, viable: float = 100.0) -> dict:
    summary = dict(rate_rps=rate, num_requests=10, num_ok=10, ttfa_p50_s=0.2, ttfa_p90_s=0.3, ttfa_p99_s=0.4,
                   pct_viable=viable, pct_chunks_on_time=100.0, worst_underrun_s=0.0, underruns_s=[],
                   stream_speed_p50_x=2.0, audio_s=10.0, errors={})  # fmt: skip
    return {"summary": summary, "audio_x": audio_x, "hops": {}}


def test_the_report_gives_the_admit_all_sweep_its_own_ratio_row_and_column():
    inproc, clus, admit_all = [_step(1, 4.0), _step(2, 8.0)], [_step(1, 3.0)], [_step(1, 3.5), _step(2, 6.0)]
    text = report(inproc, clus, SweepConfig(), admit_all)
    assert "| **cluster / in-process** | **0.50x** | **0.38x** |" in text  # capacity 1 of 2 req/s
    assert "| **admitting all / in-process** | **1.00x** | **0.75x** |" in text
    assert "| 2 | 0.30 s / 100% / 8.00 | - | 0.30 s / 100% / 6.00 |" in text

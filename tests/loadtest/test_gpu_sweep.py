"""The GPU load sweep's parts on CPU without Ray: the random checkpoints in the published layouts load through VoxRay's
own loaders and give the in-memory model's greedy frames and audio; the sweep's config keeps both halves on one
engine config; per-rate rows, capacity at SLO and the table from synthetic streams; the cluster client against a
fake gRPC server; the shell scripts parse, and sourcing cluster_run.sh only defines its functions."""

from __future__ import annotations

import asyncio
import json
import subprocess
from argparse import Namespace
from pathlib import Path

import grpc
import pytest
import torch
from transformers import LlamaConfig

from core.config import CacheConfig, ModelConfig, SchedulerConfig, load_serve_config
from core.messages import SamplingParams
from detok_stage.codecs.snac_codec import TINY_SNAC, SnacCodec
from llm_stage.engine import LLMEngine
from llm_stage.models.llama import LlamaBackbone
from llm_stage.models.orpheus import START_OF_HUMAN, VOCAB_SIZE, OrpheusAdapter
from llm_stage.registry import get_entry, model_config_for
from loadtest.gpu import cluster_sweep, sweep_compare
from loadtest.gpu import random_checkpoint as rc
from loadtest.gpu.sweep_compare import RateRow, StreamResult
from loadtest.gpu.sweep_config import served_engine_config, sweep_serve_config, write_yaml
from protos import voxray_pb2, voxray_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
SNAC_CONFIG = {**TINY_SNAC, "noise": True}


def toy_body() -> LlamaConfig:
    """Orpheus' vocab and Llama 3 rope at toy width: the writer's layout at test size."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_parameters=rc.orpheus_body(1, small=True).rope_parameters, bos_token_id=128000, eos_token_id=128258,
    )  # fmt: skip


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("ckpt")
    model = rc.random_orpheus(toy_body(), "cpu", seed=3)
    orpheus_dir = rc.write_orpheus_dir(out / "orpheus", model)
    snac_dir = rc.write_snac_dir(out / "snac", rc.random_snac(SNAC_CONFIG, seed=4), SNAC_CONFIG)
    return orpheus_dir, snac_dir


def greedy_frames(adapter: OrpheusAdapter, prompt: list[int], num_tokens: int) -> list[list[int]]:
    engine = LLMEngine(adapter, CacheConfig(num_slots=2, max_seq_len=128), SchedulerConfig(max_batch_size=2))
    engine.add_prompt("r", prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens))
    frames: list[list[int]] = []
    while engine.has_work:
        for out in engine.step():
            frames.extend(out.new_frames)
    return frames


def test_written_orpheus_loads_through_voxrays_path_with_the_in_memory_models_greedy_frames(written) -> None:
    orpheus_dir, snac_dir = written
    config = json.loads((orpheus_dir / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["torch_dtype"] == "bfloat16"  # the 4.x form
    assert "rope_parameters" not in config and (orpheus_dir / "model.safetensors").is_file()
    model_config = model_config_for(orpheus_dir, snac_dir, dtype="bfloat16")
    assert (model_config.name, model_config.codec_dir) == ("orpheus", snac_dir)  # found by its config.json
    loaded = get_entry(model_config.name).build_lm(model_config)

    reference = rc.random_orpheus(toy_body(), "cpu", seed=3)  # the same seed builds the same weights
    want, got = reference.state_dict(), loaded.backbone.hf_model.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    prompt = loaded.format_prompt("Hello there.", "tara")
    assert prompt[:2] == [START_OF_HUMAN, 128000] and len(prompt) == 2 + len("tara: Hello there.") + 4
    in_memory = OrpheusAdapter(LlamaBackbone(reference), loaded.tokenizer)
    frames = greedy_frames(loaded, prompt, 21)
    assert len(frames) == 3 and frames == greedy_frames(in_memory, prompt, 21)


def test_written_snac_decodes_as_the_in_memory_codec(written) -> None:
    _, snac_dir = written
    saved = torch.load(snac_dir / "pytorch_model.bin", weights_only=True)
    assert any(key.endswith(".weight_g") for key in saved) and not any("parametrizations" in key for key in saved)
    loaded = SnacCodec.build(ModelConfig(name="orpheus", codec_dir=snac_dir))
    in_memory = SnacCodec(rc.random_snac(SNAC_CONFIG, seed=4))
    frames = torch.randint(0, 4096, (2, 6, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded.decode(frames), in_memory.decode(frames), rtol=1e-4, atol=1e-5)


def test_both_halves_run_one_engine_config_on_the_sweeps_ports(written, tmp_path) -> None:
    orpheus_dir, snac_dir = written
    config = sweep_serve_config(REPO_ROOT / "deployments/configs/gpu-1.yaml", grpc_port=19500, http_port=18500)
    back = load_serve_config(write_yaml(config, tmp_path / "serve.yaml"))
    assert back == config and (back.grpc_port, back.http_port, back.grpc_host) == (19500, 18500, "127.0.0.1")
    engine = served_engine_config(back, orpheus_dir, snac_dir)
    assert (engine.model.name, engine.model.device, engine.model.dtype) == ("orpheus", "cuda", "bfloat16")
    assert engine.model.checkpoint_dir == str(orpheus_dir) and engine.scheduler == config.engine.scheduler
    from cluster.cli import build_parser, serve_config  # what `voxray serve` itself builds from the same flags

    args = ["serve", "--config", str(tmp_path / "serve.yaml"), "--model", str(orpheus_dir), "--codec", str(snac_dir)]
    assert serve_config(build_parser().parse_args(args)).engine == engine
    assert sweep_serve_config(None, 19500, 18500).engine.model.device == "cpu"  # CONFIG= : the CPU rehearsal


def stream(sent_s: float, ttfa_s: float | None, late_s: float = 0.0, code: str = "OK") -> StreamResult:
    """Four 0.5 s chunks 0.4 s apart from `ttfa_s`, the last two `late_s` later (past 0.2 s: an underrun);
    None: no audio."""
    if ttfa_s is None:
        return StreamResult(sent_s=sent_s, ended_s=sent_s + 0.02, code=code)
    arrivals = [ttfa_s, ttfa_s + 0.4, ttfa_s + 0.8 + late_s, ttfa_s + 1.2 + late_s]
    return StreamResult(sent_s, sent_s + arrivals[-1], arrivals, [0.5] * 4, code)


def test_cluster_row_counts_refusals_apart_from_admitted_streams() -> None:
    refused = stream(0.3, None, code="RESOURCE_EXHAUSTED")
    streams = [
        stream(0.0, 0.2),
        stream(0.1, 0.3),
        stream(0.2, 0.4, late_s=0.5),
        refused,
        stream(0.4, 0.25, code="CAPPED"),
    ]
    row = sweep_compare.cluster_row(4.0, streams, wall_s=2.0)
    assert (row.sent, row.admitted, row.refused, row.capped) == (5, 4, 1, True)
    assert row.pct_viable == 50.0  # the late one and the capped one are not
    assert row.p90_ttfa_s is None  # the capped stream never finished OK: it counts as never starting
    assert row.reject_p50_ms == pytest.approx(20.0) and row.errors == {"RESOURCE_EXHAUSTED": 1, "CAPPED": 1}
    assert row.peak_streams == 4 and row.audio_x_rt == pytest.approx(4.0)  # 4 admitted x 2 s audio over 2 s


def test_playback_row_counts_silent_streams_as_never_starting() -> None:
    row = sweep_compare.playback_row(2.0, [0.1] * 9 + [None], [True] * 9 + [False], 5, 30.0, 10.0, capped=False)
    assert (row.sent, row.admitted, row.refused, row.pct_viable, row.audio_x_rt) == (10, 10, 0, 90.0, 3.0)
    assert row.p50_ttfa_s == pytest.approx(0.1) and row.p90_ttfa_s is None


def test_inprocess_row_counts_unsent_and_unfinished_streams_as_not_viable() -> None:
    from loadtest.gpu.inprocess_sweep import row_of
    from loadtest.gpu_bench_pipeline import RateRun
    from router.playback import PlaybackTracker

    streams = RateRun(arrivals_s=[0.0, 0.1, 0.2, 0.3], peak_active=3, audio_s=6.0)
    for index, first_audio_s in enumerate((0.2, 0.35, None)):  # the fourth was never sent: the cap came first
        tracker = PlaybackTracker(start_s=0.1 * index)
        if first_audio_s is not None:
            tracker.on_chunk(first_audio_s, 1.0)
            tracker.on_chunk(first_audio_s + 0.5, 1.0)
        streams.trackers[f"r{index}"] = tracker
    streams.finished = {"r0"}  # r1 was cut by the cap mid-stream
    row = row_of(2.0, streams, wall_s=3.0, cap_s=3.0)
    assert (row.sent, row.admitted, row.pct_viable, row.peak_streams, row.capped) == (4, 4, 25.0, 3, True)
    assert row.p50_ttfa_s is None and row.p90_ttfa_s is None and row.audio_x_rt == 2.0  # half never played


def row(rate: float, p90_s: float | None, viable: float = 100.0, refused: int = 0, peak: int = 10) -> RateRow:
    return RateRow(rate_rps=rate, sent=100, admitted=100 - refused, refused=refused, p50_ttfa_s=p90_s,
                   p90_ttfa_s=p90_s, pct_viable=viable, peak_streams=peak, audio_x_rt=rate * 7.2)  # fmt: skip


def test_capacity_at_slo_stops_at_the_first_miss_and_limits_refusals() -> None:
    rows = [row(2, 0.2), row(4, 0.28), row(8, 0.45), row(16, 0.2, viable=98.0), row(24, 0.3)]
    assert sweep_compare.capacity_rps(rows, 0.5) == 8 and sweep_compare.capacity_rps(rows, 0.3) == 4
    refusing = [row(2, 0.2), row(4, 0.2, refused=5), row(8, 0.2, refused=40)]
    assert sweep_compare.capacity_rps(refusing, 0.5) == 2
    assert sweep_compare.capacity_rps(refusing, 0.5, max_refused_pct=None) == 8
    assert sweep_compare.served_rps(refusing, 0.5) == pytest.approx(4.8)  # 8 req/s, 60% admitted
    skipped = [row(2, 0.2), RateRow(rate_rps=4, skipped="out of time")]
    assert sweep_compare.capacity_rps(skipped, 0.5) == 2 and sweep_compare.is_saturated(skipped[1], 5.0)
    assert sweep_compare.is_saturated(row(8, None), 5.0) and not sweep_compare.is_saturated(row(8, 4.0), 5.0)


def test_report_compares_capacities_and_tables_every_rate() -> None:
    inprocess = {"rows": [vars(r) for r in (row(2, 0.2, peak=14), row(4, 0.4, peak=29), row(8, 2.0))],
                 "c1_warm_ttfa_s": 0.12, "hf_generate": {"tokens": 196, "x_real_time": 0.21}, "arrival_s": 8,
                 "audio_s_per_stream": 7.17}  # fmt: skip
    cluster = {"rows": [vars(r) for r in (row(2, 0.25), row(4, 0.35, refused=1), row(8, 0.3, refused=30))],
               "c1_warm_ttfa_s": 0.15, "ttfa_deadline_s": 0.5}  # fmt: skip
    report = sweep_compare.compare(inprocess, cluster, {"gpu": "H200", "commit": "abc1234"})
    head = report["headline"]
    assert head["500ms"]["inprocess_capacity_rps"] == 4 and head["500ms"]["cluster_capacity_rps"] == 4
    assert head["500ms"]["cluster_over_inprocess"] == 1.0 and head["500ms"]["inprocess_peak_streams"] == 29
    assert head["300ms"]["inprocess_capacity_rps"] == 2 and head["300ms"]["cluster_capacity_rps"] == 2
    assert head["300ms"]["cluster_capacity_refusals_allowed_rps"] == 2  # 4 req/s: p90 350 ms
    assert head["500ms"]["cluster_capacity_refusals_allowed_rps"] == 8
    table = sweep_compare.markdown(report)
    assert "| capacity at SLO, p90 TTFA <= 500 ms" in table and "| 4 req/s | 4 req/s | 1x |" in table
    assert "H200, commit abc1234" in table and "0.21x real time" in table
    assert sum(line.startswith(("| 2 |", "| 4 |", "| 8 |")) for line in table.splitlines()) == 6
    assert json.loads(json.dumps(report))["headline"] == head  # JSON-safe


class FakeSpeech(voxray_pb2_grpc.SpeechServicer):
    """Refuses every third seed; streams three 0.2 s chunks to the rest."""

    async def Synthesize(self, request, context):  # noqa: N802 (the gRPC method's name)
        if request.sampling.seed % 3 == 2:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        for seq in range(3):
            await asyncio.sleep(0.01)
            yield voxray_pb2.AudioChunk(seq=seq, duration_s=0.2, final=seq == 2)


def test_cluster_client_plays_each_arrival_and_tells_refusals_from_admitted() -> None:
    async def run() -> tuple[list[StreamResult], float]:
        server = grpc.aio.server()
        voxray_pb2_grpc.add_SpeechServicer_to_server(FakeSpeech(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        args = Namespace(arrival_s=0.3, max_tokens=21, voice="tara", ttfa_deadline_s=0.5, app="voxray",
                         request_timeout_s=30.0)  # fmt: skip
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await cluster_sweep.play_rate([voxray_pb2_grpc.SpeechStub(channel)], 20.0, args, cap_s=30.0)
        finally:
            await server.stop(None)

    streams, wall_s = asyncio.run(run())
    assert len(streams) == 6  # round(20 req/s x 0.3 s), the in-process player's arrivals
    codes = [s.code for s in streams]
    assert codes == ["RESOURCE_EXHAUSTED" if i % 3 == 2 else "OK" for i in range(6)]
    row = sweep_compare.cluster_row(20.0, streams, wall_s)
    assert (row.sent, row.refused, row.admitted) == (6, 2, 4) and row.reject_p99_ms is not None
    assert all(len(s.durations_s) == 3 for s in streams if s.code == "OK")


def test_scripts_parse_and_sourcing_cluster_run_only_defines_its_functions(tmp_path) -> None:
    for script in ("loadtest/gpu/sweep_run.sh", "loadtest/gpu/cluster_run.sh"):
        subprocess.run(["bash", "-n", str(REPO_ROOT / script)], check=True, timeout=30)
    sourced = subprocess.run(
        ["bash", "-c", "source loadtest/gpu/cluster_run.sh && declare -F install_wheels read_ports start_serve "
         "wait_ready stop_serve ray_import_errors stop_on_exit && echo \"$LOG_DIR $CODEC.\""],
        cwd=REPO_ROOT, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert sourced.returncode == 0, sourced.stderr
    assert sourced.stdout.splitlines()[-1] == f"{tmp_path} ." and sourced.stdout.count("\n") == 8
    assert list(tmp_path.iterdir()) == []  # nothing ran: no serve.log, no ray_start.json
    runner = (REPO_ROOT / "loadtest/gpu/sweep_run.sh").read_text()
    assert 'source "$(dirname "${BASH_SOURCE[0]}")/cluster_run.sh"' in runner

"""Seconds-long smoke sweeps (2 rates, a few requests) so the harness keeps working end to end:
VoxRay in its own local Ray (subprocess, own ports) and the naive baseline's servicer in-process.
No timing assertions: only that every request streamed audio and the outputs were written."""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from core.config import ModelConfig
from detok_stage.codecs.snac_codec import SnacCodec
from llm_stage.models.orpheus import OrpheusAdapter
from loadtest import run_all
from loadtest.baselines.naive_server import NaiveSpeech
from loadtest.plots import plot_all
from loadtest.sweep import SweepConfig, run_sweep, write_result
from protos import voxray_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.own_server]
_OFFSET = int(os.environ.get("VOXRAY_TEST_PORT_OFFSET", "0"))  # see tests/deployments/conftest.py
VOXRAY_GRPC_PORT, VOXRAY_HTTP_PORT, NAIVE_PORT = (p + _OFFSET for p in (19210, 19211, 19212))
SMOKE = SweepConfig(rates_rps=(2.0, 4.0), duration_s=1.0, min_requests=2, max_requests=3, max_tokens_cap=35,
                    request_timeout_s=120.0, stop_p90_ttfa_s=1e9)  # fmt: skip


def check_sweep(result, tmp_path) -> None:
    assert [s["summary"]["rate_rps"] for s in result.steps] == [2.0, 4.0]
    for step in result.steps:
        summary = step["summary"]
        assert 2 <= summary["num_requests"] <= 3 and summary["num_ok"] == summary["num_requests"], summary["errors"]
        assert summary["audio_s"] > 0 and summary["ttfa_p90_s"] is not None
    path = write_result(result, tmp_path)
    assert json.loads(path.read_text())["label"] == result.label
    assert all(p.stat().st_size > 0 for p in plot_all([json.loads(path.read_text())], tmp_path, 1.0))


@pytest.fixture(scope="module")
def voxray_target(tmp_path_factory):
    command = [sys.executable, "-m", "loadtest.serve_voxray", "--grpc-port", str(VOXRAY_GRPC_PORT),
               "--http-port", str(VOXRAY_HTTP_PORT)]  # fmt: skip
    system = run_all.System("voxray", VOXRAY_GRPC_PORT, command, 240.0)
    proc = run_all.start_ready(system, tmp_path_factory.mktemp("voxray-log"), "voxray")
    try:
        yield f"127.0.0.1:{VOXRAY_GRPC_PORT}"
    finally:
        run_all.stop(proc)


def test_voxray_smoke_sweep(voxray_target, tmp_path):
    check_sweep(run_sweep(voxray_target, SMOKE, "voxray-smoke"), tmp_path)


@pytest.fixture(scope="module")
def naive_target():
    model = OrpheusAdapter.build(ModelConfig(name="orpheus-tiny")).backbone.hf_model
    codec = SnacCodec.build(ModelConfig(name="orpheus-tiny"))
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    voxray_pb2_grpc.add_SpeechServicer_to_server(NaiveSpeech(model, codec.model), server)
    server.add_insecure_port(f"127.0.0.1:{NAIVE_PORT}")
    server.start()
    yield f"127.0.0.1:{NAIVE_PORT}"
    server.stop(grace=1.0).wait()


def test_naive_baseline_smoke_sweep(naive_target, tmp_path):
    check_sweep(run_sweep(naive_target, SMOKE, "naive-smoke"), tmp_path)


def test_sweep_refuses_remote_targets():
    with pytest.raises(ValueError, match="allow-remote"):
        run_sweep("192.0.2.10:9000", SMOKE, "remote")

"""`voxray serve --model chatterbox-tiny` onto the running test cluster, then `voxray say` and
concurrent gRPC streams: T3 (with its CFG twin) on the LLMStage, the S3Gen flow detokenizer on the
DetokStage, chunks crossing Ray with the stream from token 0 as history. The cluster's audio
equals the in-process pipeline's for the same seeded requests. A zero-shot voice registered on the
same app conditions both T3 and S3Gen (its in-process checks: tests/deployments/test_chatterbox_voices.py)."""

from __future__ import annotations

import wave
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import yaml
from ray import serve

from cluster.cli import main
from core.config import AdmissionConfig, StageDeploymentConfig
from tests.deployments.conftest import small_config
from tests.deployments.grpc_helpers import run_stream
from tests.deployments.test_cluster import in_process_audio
from tests.deployments.test_zz_voices import register_grpc
from tests.detok_stage.test_voice_clip import wav_bytes

pytestmark = pytest.mark.slow
S3GEN = small_config(
    app_name="voxray-s3gen", route_prefix="/s3gen", llm=StageDeploymentConfig(num_cpus=0.25),
    detok=StageDeploymentConfig(num_cpus=0.25), router=StageDeploymentConfig(num_cpus=0.25),
    admission=AdmissionConfig(max_streams_per_replica=4, max_queued_per_replica=4, default_ttfa_deadline_s=120.0),
)  # fmt: skip
# S3Gen in another batch composition: ~6e-5 float noise through the NSF phase, plus PCM16 rounding
MAX_PCM_STEPS = 8


def test_serve_chatterbox_tiny_then_say_and_streams_match_in_process(cluster, tmp_path, capsys):
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(S3GEN.model_dump(mode="json")))
    try:
        assert main(["serve", "--no-block", "--config", str(config_file), "--model", "chatterbox-tiny"]) == 0
        assert "VoxRay serving chatterbox-tiny" in capsys.readouterr().out
        target = f"127.0.0.1:{S3GEN.grpc_port}"
        out = tmp_path / "say.wav"
        say = ["say", "Hello from the flow detokenizer.", "-o", str(out), "--target", target, "--app", S3GEN.app_name]
        assert main([*say, "--max-tokens", "60"]) == 0
        assert "TTFA" in capsys.readouterr().out
        with wave.open(str(out)) as wav:
            assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
            assert 0 < wav.getnframes() <= 60 * 960 and wav.getnframes() % 960 == 0

        jobs = [{"request_id": f"s3g-{i}", "text": f"flow stream {i}", "voice": "default",
                 "sampling": {"seed": 10 + i, "max_tokens": 40 + 15 * i}} for i in range(3)]  # fmt: skip
        with ThreadPoolExecutor(3) as pool:
            outcomes = list(pool.map(lambda job: run_stream(target, S3GEN.app_name, **job), jobs))
        model = S3GEN.engine.model.model_copy(update={"name": "chatterbox-tiny"})
        expected = in_process_audio(jobs, S3GEN.engine.model_copy(update={"model": model}))
        for job, outcome in zip(jobs, outcomes, strict=True):
            assert outcome.code == grpc.StatusCode.OK, outcome.details
            got = np.frombuffer(outcome.pcm16, dtype="<i2").astype(np.int32)
            want = np.frombuffer(expected[job["request_id"]], dtype="<i2").astype(np.int32)
            assert got.shape == want.shape and got.size > 0, job["request_id"]
            assert np.abs(got - want).max() <= MAX_PCM_STEPS, job["request_id"]
        _a_registered_voice_conditions_t3_and_s3gen(target, jobs[0], outcomes[0])
    finally:
        serve.delete(S3GEN.app_name)


def _a_registered_voice_conditions_t3_and_s3gen(target: str, job: dict, default) -> None:
    """A clip registered over gRPC (twice: one id, encoded once) and a stream in its voice: the same
    seeded request as `default` (the built-in voice) gives other audio. (Determinism and the
    tokens: the in-process tests; one stream here keeps this app's cost down.)"""
    clip = wav_bytes(seconds=3.0, rate=16_000, amplitude=0.4)
    first, again = (register_grpc(target, S3GEN.app_name, clip) for _ in range(2))
    assert first.created and not again.created and first.voice_id == again.voice_id
    assert first.prompt_tokens == 75  # S3Gen's reference: 3 s at 25 Hz
    voiced = run_stream(target, S3GEN.app_name, **{**job, "request_id": "s3g-voice", "voice": first.voice_id})
    assert voiced.code == grpc.StatusCode.OK, voiced.details
    want, got = (np.frombuffer(o.pcm16, dtype="<i2").astype(np.int32) for o in (default, voiced))
    assert got.size > 0 and (got.shape != want.shape or np.abs(got - want).max() > 100 * MAX_PCM_STEPS)

"""`voxray serve` (what `make serve` runs) and `voxray say` through their CLI entry points.

Runs last in this package: it redeploys the `voxray` app from a ServeConfig YAML file.
"""

from __future__ import annotations

import wave

import pytest
import yaml

from cluster.cli import main
from tests.deployments.conftest import TIGHT

pytestmark = pytest.mark.slow


def test_serve_cli_deploys_and_say_writes_a_valid_wav(cluster, tmp_path, capsys):
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(TIGHT.model_dump(mode="json")))
    assert main(["serve", "--no-block", "--config", str(config_file)]) == 0
    printed = capsys.readouterr().out
    assert f"gRPC: 127.0.0.1:{TIGHT.grpc_port}" in printed and "/v1/audio/speech" in printed
    out = tmp_path / "say.wav"
    target = f"127.0.0.1:{TIGHT.grpc_port}"
    assert main(["say", "Hello from the CLI.", "-o", str(out), "--target", target, "--max-tokens", "70"]) == 0
    assert "TTFA" in capsys.readouterr().out
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert wav.getnframes() == 10 * 2048


def test_say_reports_grpc_errors(cluster, tmp_path, capsys):
    out = tmp_path / "bad.wav"
    assert main(["say", "hi", "--voice", "nobody", "-o", str(out), "--target", f"127.0.0.1:{TIGHT.grpc_port}"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err and not out.exists()

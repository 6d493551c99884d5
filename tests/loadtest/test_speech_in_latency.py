"""`loadtest.speech_in_latency` runs end to end at a small size: a spoken and a text-only answer per clip
length, each with its first text (the text-only one always) and the spoken one with its first audio."""

from __future__ import annotations

import pytest

from loadtest.speech_in_latency import main


@pytest.mark.parametrize("model", ["step-audio2-tiny", "glm4-voice-tiny"])
def test_the_latency_bench_measures_first_text_and_audio_per_clip_length(tmp_path, model):
    argv = ["--model", model, "--seconds", "1", "3", "--repeats", "1", "--max-tokens", "40"]
    report = main([*argv, "--out", str(tmp_path / "r.json")])
    assert report["model"] == model and set(report["by_clip_s"]) == {"1.0", "3.0"}
    for row in report["by_clip_s"].values():
        assert row["text_only"]["first_text_s"] > 0 and row["text_only"]["first_audio_s"] is None
        assert row["spoken"]["first_audio_s"] is None or row["spoken"]["first_audio_s"] > 0
    assert (tmp_path / "r.json").exists()

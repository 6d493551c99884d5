"""`voxray synthesize` end to end in-process, and registry / config errors."""

from __future__ import annotations

import wave

import pydantic
import pytest

from cluster.cli import main
from cluster.pipeline import InProcessPipeline
from core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from core.errors import InvalidArgumentError
from llm_stage.registry import check_model_config, get_entry


@pytest.mark.parametrize("schedule", ["wide", "reference"])
def test_synthesize_writes_wav_matching_token_count(tmp_path, schedule):
    out = tmp_path / "out.wav"
    code = main(
        ["synthesize", "--text", "Hello from VoxRay.", "--max-tokens", "70", "--schedule", schedule, "-o", str(out)]
    )
    assert code == 0
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert wav.getnframes() == 70 // 7 * 2048


def test_pipeline_streams_many_requests_in_seq_order():
    pipeline = InProcessPipeline(
        EngineConfig(cache=CacheConfig(num_slots=4, max_seq_len=512), scheduler=SchedulerConfig(max_batch_size=4))
    )
    for i in range(4):
        pipeline.submit(f"r{i}", f"request number {i}", "zoe", {"max_tokens": 7 * (3 + 4 * i), "seed": i})
    seqs: dict[str, list[int]] = {}
    samples: dict[str, int] = {}
    for chunk in pipeline.stream():
        seqs.setdefault(chunk.req_id, []).append(chunk.seq)
        samples[chunk.req_id] = samples.get(chunk.req_id, 0) + chunk.num_samples
    for i in range(4):
        assert seqs[f"r{i}"] == list(range(len(seqs[f"r{i}"])))
        assert samples[f"r{i}"] == (3 + 4 * i) * 2048


def test_unknown_model_lists_valid_names():
    with pytest.raises(InvalidArgumentError) as err:
        get_entry("nope")
    assert err.value.field == "model" and "orpheus-tiny" in str(err.value)
    assert main(["synthesize", "--model", "nope", "--text", "x"]) == 2


def test_checkpoint_models_need_directories():
    with pytest.raises(InvalidArgumentError) as err:
        check_model_config(ModelConfig(name="orpheus"))
    assert err.value.field == "model.checkpoint_dir"


def test_config_rejects_unknown_fields_and_bad_values():
    with pytest.raises(pydantic.ValidationError):
        EngineConfig.model_validate({"cache": {"num_slot": 3}})
    with pytest.raises(pydantic.ValidationError):
        EngineConfig(cache=CacheConfig(num_slots=2), scheduler=SchedulerConfig(max_batch_size=8))


def test_synthesize_qwen3_tts_tiny_in_process(tmp_path):
    """`voxray synthesize --model qwen3-tts-tiny`: talker + code predictor in the engine, the causal
    tokenizer decoder streaming in the detokenizer, 1920 samples per 12.5 Hz frame."""
    out = tmp_path / "qwen3.wav"
    argv = ["synthesize", "--model", "qwen3-tts-tiny", "--voice", "eric", "--text", "Hello.", "--max-tokens", "12"]
    assert main([*argv, "-o", str(out)]) == 0
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert 0 < wav.getnframes() <= 12 * 1920 and wav.getnframes() % 1920 == 0

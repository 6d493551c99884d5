"""Request validation at the ingress (one Job per request, limits from the model family) and
the model metadata the router serves (ListVoices / ListModels), for every family."""

from __future__ import annotations

import pytest

from core.config import AdmissionConfig, ModelConfig
from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from llm_stage.registry import get_entry, model_names
from protos import voxray_pb2
from router.ingress import models_response, voices_response
from router.jobs import job_from_fields, sampling_from_proto

PRESETS = [name for name in model_names() if name.endswith("-tiny")]


def fields(**overrides) -> dict:
    base = {
        "text": "Hello there.", "model": "", "voice": "", "sampling": {}, "output_format": "pcm16",
        "sample_rate_hz": 0, "ttfa_deadline_s": 0.0, "req_id": "",
    }  # fmt: skip
    return {**base, **overrides}


@pytest.mark.parametrize("name", model_names())
def test_list_voices_returns_exactly_the_voices_the_family_accepts(name):
    entry = get_entry(name)
    response = voices_response(entry)
    assert list(response.voices) == list(entry.family.lm.voices)
    for voice in response.voices:
        assert job_from_fields(entry, AdmissionConfig(), **fields(voice=voice)).voice == voice
    with pytest.raises(InvalidArgumentError) as err:
        job_from_fields(entry, AdmissionConfig(), **fields(voice="no-such-voice"))
    assert err.value.field == "voice"
    default = job_from_fields(entry, AdmissionConfig(), **fields()).voice
    assert default == (response.default_voice or None)


def test_csm_lists_its_ten_speakers():
    assert list(voices_response(get_entry("csm-tiny")).voices) == [str(i) for i in range(10)]


@pytest.mark.parametrize("name", PRESETS)
def test_declared_sample_rate_is_the_codecs(name):
    entry = get_entry(name)
    codec = entry.build_codec(ModelConfig(name=name), "cpu")
    assert codec.sample_rate_hz == entry.sample_rate_hz
    assert models_response(entry).models[0].sample_rate_hz == entry.sample_rate_hz


def test_job_carries_resolved_sampling_and_names_fields_as_spelled():
    entry = get_entry("orpheus-tiny")
    job = job_from_fields(entry, AdmissionConfig(), **fields(sampling={"temperature": 0.0}))
    assert job.sampling == SamplingParams.resolve({"temperature": 0.0}, entry.default_sampling)
    assert job.sampling.top_p == entry.default_sampling.top_p
    for text in ("", "   ", "x" * (entry.family.lm.max_text_chars + 1)):
        with pytest.raises(InvalidArgumentError) as err:
            job_from_fields(entry, AdmissionConfig(), **fields(text=text), text_field="input")
        assert err.value.field == "input"
    with pytest.raises(InvalidArgumentError) as err:
        job_from_fields(entry, AdmissionConfig(), **fields(sampling={"top_p": 0}))
    assert err.value.field == "sampling.top_p"
    with pytest.raises(InvalidArgumentError) as err:
        job_from_fields(entry, AdmissionConfig(), **fields(ttfa_deadline_s=float("nan")))
    assert err.value.field == "ttfa_deadline_s"


def test_grpc_clients_can_ask_for_guidance():
    options = voxray_pb2.SamplingOptions(guidance_scale=2.5, temperature=0.0)
    entry = get_entry("dia-tiny")
    job = job_from_fields(entry, AdmissionConfig(), **fields(sampling=sampling_from_proto(options)))
    assert job.sampling.guidance_scale == 2.5 and job.sampling.temperature == 0.0
    unset = job_from_fields(entry, AdmissionConfig(), **fields())
    assert unset.sampling.guidance_scale == entry.default_sampling.guidance_scale

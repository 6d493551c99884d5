"""Strict request validation at the ingress (`router.jobs` + `llm_stage.jobs`): every malformed
input from issue 24 is an InvalidArgumentError naming the field, and (hypothesis) no input of
either protocol raises anything else."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.config import AdmissionConfig
from core.errors import InvalidArgumentError
from core.messages import Job
from llm_stage.registry import get_entry
from protos import voxray_pb2
from router.jobs import (
    HTTP_FIELDS,
    MAX_BODY_BYTES,
    fields_from_json,
    fields_from_proto,
    job_from_fields,
    speech_request,
)

ENTRY = get_entry("orpheus-tiny")
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def grpc_job(request: voxray_pb2.SynthesizeRequest | bytes) -> Job:
    return job_from_fields(ENTRY, AdmissionConfig(), **fields_from_proto(request))


def http_job(body: bytes | dict, header_ids: list[str] = ()) -> Job:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return job_from_fields(ENTRY, AdmissionConfig(), **fields_from_json(raw, list(header_ids)))


def field_of(call, *args) -> str:
    with pytest.raises(InvalidArgumentError) as err:
        call(*args)
    return err.value.field


GOOD = voxray_pb2.SynthesizeRequest(text="hello there", request_id="r-1").SerializeToString()
GRPC_BAD = [
    (b"\xff\xff\xff\xff garbage", "request"),
    (GOOD[:-3], "request"),  # truncated
    (b"\x0a\x02\xff\xfe", "request"),  # text that is not UTF-8
    (b"\x0a\x05\xe2\x82", "request"),  # a length running past the end
    (GOOD + b"\xa0\x06\x01", "request"),  # unknown field 100
    (voxray_pb2.SynthesizeRequest(text="hi", format=7).SerializeToString(), "format"),
    (voxray_pb2.SynthesizeRequest(text="hi", ttfa_deadline_s=float("nan")), "ttfa_deadline_s"),
    (voxray_pb2.SynthesizeRequest(text="hi", ttfa_deadline_s=float("inf")), "ttfa_deadline_s"),
    (voxray_pb2.SynthesizeRequest(text="hi", ttfa_deadline_s=1e9), "ttfa_deadline_s"),
    (voxray_pb2.SynthesizeRequest(text="hi", ttfa_deadline_s=-1), "ttfa_deadline_s"),
    (voxray_pb2.SynthesizeRequest(text="a\x00b"), "text"),
    (voxray_pb2.SynthesizeRequest(text="a\x1bb"), "text"),
    (voxray_pb2.SynthesizeRequest(text="hi", request_id="a\r\nb"), "request_id"),
    (voxray_pb2.SynthesizeRequest(text="hi", request_id="a\x00b"), "request_id"),
    (voxray_pb2.SynthesizeRequest(text="hi", request_id="r-€-1"), "request_id"),
    (voxray_pb2.SynthesizeRequest(text="hi", request_id="has space"), "request_id"),
    (voxray_pb2.SynthesizeRequest(text="hi", request_id="x" * 129), "request_id"),
    (voxray_pb2.SynthesizeRequest(text="hi", voice="tara\n"), "voice"),
    (voxray_pb2.SynthesizeRequest(text="hi", model="m" * 1000), "model"),
    (voxray_pb2.SynthesizeRequest(text="hi", sampling=voxray_pb2.SamplingOptions(temperature=float("nan"))),
     "sampling.temperature"),
    (voxray_pb2.SynthesizeRequest(text="hi", sampling=voxray_pb2.SamplingOptions(top_p=float("inf"))),
     "sampling.top_p"),
    (voxray_pb2.SynthesizeRequest(text="hi", sampling=voxray_pb2.SamplingOptions(max_tokens=-5)),
     "sampling.max_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("request_", "field"), GRPC_BAD)
def test_grpc_bad_input_names_the_field(request_, field):
    assert field_of(grpc_job, request_) == field


def test_grpc_good_request_parses_from_bytes_and_keeps_its_id():
    job = grpc_job(GOOD)
    assert (job.req_id, job.text, job.output_format) == ("r-1", "hello there", "pcm16")
    wav = voxray_pb2.SynthesizeRequest(text="hi", format=voxray_pb2.AUDIO_FORMAT_WAV).SerializeToString()
    assert grpc_job(wav).output_format == "wav"


def test_prose_whitespace_is_text_not_a_control_character():
    assert grpc_job(voxray_pb2.SynthesizeRequest(text="line one.\r\n\tline two.")).text.endswith("two.")


HTTP_BAD = [
    (b'{"input": "\\ud800"}', "input"),  # lone surrogate
    (b'{"input": "hi\\u0000"}', "input"),
    (b'{"input": "hi", "request_id": "a\\r\\nb"}', "request_id"),
    (b'{"input": "hi", "request_id": "r-\\u20ac-1"}', "request_id"),
    (b'{"input": "hi", "request_id": 7}', "request_id"),
    ({"input": "hi", "response_format": ["wav"]}, "response_format"),
    ({"input": "hi", "response_format": "mp3"}, "response_format"),
    ({"input": "hi", "speed": True}, "speed"),
    ({"input": "hi", "speed": "1.0"}, "speed"),
    ({"input": "hi", "speed": 2}, "speed"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": "hi", "sampling": {"max_tokens": True}}, "sampling.max_tokens"),
    ({"input": "hi", "sampling": {"max_tokens": 7.5}}, "sampling.max_tokens"),
    ({"input": "hi", "sampling": {"temperature": "0.5"}}, "sampling.temperature"),
    ({"input": "hi", "sampling": {"temperature": {"a": 1}}}, "sampling.temperature"),
    ({"input": "hi", "sampling": {"colour": 1}}, "sampling.colour"),
    ({"input": "hi", "sampling": [1, 2]}, "sampling"),
    ({"input": "hi", "voice": 3}, "voice"),
    ({"input": "hi", "model": ["orpheus-tiny"]}, "model"),
    ({"input": ["hi"]}, "input"),
    ({"input": "hi", "colour": "red"}, "colour"),
    ({"text": "hi"}, "text"),
    (b'{"input": "hi", "sampling": {"temperature": NaN}}', "body"),
    (b'{"input": "hi", "sampling": {"top_p": Infinity}}', "body"),
    (b'{"input": "hi", "sampling": {"temperature": 1e999}}', "sampling.temperature"),
    (b'{"input": "a", "input": "b"}', "input"),
    (b'{"input": "hi"' + b"\xff" + b"}", "body"),  # not UTF-8
    (b"[" * 100_000, "body"),  # over the size limit
    (b"[" * 5000 + b"]" * 5000, "body"),  # nesting past the parser's recursion limit
    (b'{"input": ' + b'{"a": ' * 500 + b"1" + b"}" * 501, "input"),
    (b'["input"]', "body"),
    (b'{"input": "hi"', "body"),
]


@pytest.mark.parametrize(("body", "field"), HTTP_BAD)
def test_http_bad_input_names_the_field(body, field):
    assert field_of(http_job, body) == field


def test_http_request_id_is_one_per_request():
    assert http_job({"input": "hi"}, ["abc"]).req_id == "abc"
    assert http_job({"input": "hi", "request_id": "abc"}, ["abc"]).req_id == "abc"
    assert field_of(http_job, {"input": "hi"}, ["a", "b"]) == "X-Request-Id"
    assert field_of(http_job, {"input": "hi"}, ["r-\xe2\x82\xac-1"]) == "X-Request-Id"  # UTF-8 read as latin-1
    assert field_of(http_job, {"input": "hi", "request_id": "abc"}, ["xyz"]) == "request_id"


def test_body_limit_leaves_room_for_the_longest_escaped_text():
    text = "\u00e9" * ENTRY.family.lm.max_text_chars
    body = json.dumps({"input": text}).encode()  # every character escaped as \\u00e9
    assert len(body) <= MAX_BODY_BYTES and http_job(body).text == text


# ---- properties ---------------------------------------------------------------------------


def assert_safe_error(err: InvalidArgumentError) -> None:
    """An error a client may see: a printable ASCII field name and a message that encodes."""
    assert err.field and err.field.isascii() and err.field.isprintable()
    str(err).encode("utf-8")


def assert_valid_job(job: Job) -> None:
    assert job.req_id.isascii() and job.req_id.isprintable() and " " not in job.req_id
    assert job.text.strip() and all(ch in "\t\n\r" or ord(ch) >= 0x20 for ch in job.text)
    job.text.encode("utf-8")
    assert math.isfinite(job.ttfa_deadline_s) and 0 < job.ttfa_deadline_s <= 300
    assert job.output_format in ("pcm16", "wav")


@FUZZ
@given(st.binary(max_size=300))
def test_any_grpc_bytes_give_a_job_or_a_named_field(raw):
    try:
        assert_valid_job(grpc_job(raw))
    except InvalidArgumentError as err:
        assert_safe_error(err)


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
sampling_options = st.builds(
    voxray_pb2.SamplingOptions,
    temperature=floats, top_k=st.integers(-(2**31), 2**31 - 1), top_p=floats, min_p=floats,
    max_tokens=st.integers(-(2**31), 2**31 - 1), seed=st.integers(-(2**63), 2**63 - 1),
)  # fmt: skip
proto_requests = st.builds(
    voxray_pb2.SynthesizeRequest,
    text=st.text(max_size=60), model=st.sampled_from(["", "orpheus-tiny", "nope"]) | st.text(max_size=8),
    voice=st.sampled_from(["", "tara", "leah"]) | st.text(max_size=8), sampling=sampling_options,
    format=st.integers(-3, 5), sample_rate_hz=st.sampled_from([0, 24000, 8000]), ttfa_deadline_s=floats,
    request_id=st.text(max_size=140),
)  # fmt: skip


@FUZZ
@given(proto_requests)
def test_any_grpc_message_gives_a_job_or_a_named_field(request):
    raw = request.SerializeToString()
    try:
        job = grpc_job(raw)
    except InvalidArgumentError as err:
        assert_safe_error(err)
        return
    assert_valid_job(job)
    assert job.text == request.text and request.format in (0, 1)


json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
known_keys = st.sampled_from(sorted(HTTP_FIELDS))
sampling_keys = st.sampled_from(["temperature", "top_k", "top_p", "max_tokens", "seed", "min_p", "guidance_scale"])
http_bodies = st.dictionaries(
    known_keys | st.text(max_size=6),
    json_values | st.dictionaries(sampling_keys, json_scalars, max_size=3) | st.text(max_size=80),
    max_size=6,
)  # fmt: skip


@FUZZ
@given(http_bodies, st.lists(st.text(max_size=20).map(lambda s: s.encode("utf-8").decode("latin-1")), max_size=2))
def test_any_json_body_gives_a_job_or_a_named_field(body, header_ids):
    try:
        job = http_job(json.dumps(body).encode(), header_ids)
    except InvalidArgumentError as err:
        assert_safe_error(err)
        return
    assert_valid_job(job)
    assert job.text == body["input"] and job.text_field == "input"


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_any_http_bytes_give_a_job_or_a_named_field(raw):
    try:
        assert_valid_job(http_job(raw))
    except InvalidArgumentError as err:
        assert_safe_error(err)


@pytest.mark.parametrize("value", ["events", "", 1, None, ["sse"]])
def test_http_stream_format_must_be_audio_or_sse(value):
    body = json.dumps({"input": "hi", "stream_format": value}).encode()
    with pytest.raises(InvalidArgumentError) as err:
        speech_request(body)
    assert err.value.field == "stream_format"


@pytest.mark.parametrize("value", ["audio", "sse"])
def test_http_stream_format_is_returned(value):
    fields, stream_format = speech_request(json.dumps({"input": "hi", "stream_format": value}).encode())
    assert stream_format == value and fields["text"] == "hi"

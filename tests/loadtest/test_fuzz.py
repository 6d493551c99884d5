"""loadtest/fuzz.py's request makers: seeded, a mix of valid and malformed, and every one of them
answered by the ingress validators with a Job or an error naming a field (no server needed)."""

from __future__ import annotations

import random

from core.config import AdmissionConfig
from core.errors import InvalidArgumentError
from llm_stage.registry import get_entry
from loadtest.fuzz import Fuzzer, is_failure
from router.jobs import fields_from_json, fields_from_proto, job_from_fields

ENTRY = get_entry("orpheus-tiny")


def outcome(fields_of, *args) -> str:
    try:
        job_from_fields(ENTRY, AdmissionConfig(), **fields_of(*args))
        return "job"
    except InvalidArgumentError:
        return "invalid"


def test_requests_are_seeded_and_mixed():
    fuzzer = Fuzzer(0)
    assert fuzzer.grpc_payload(random.Random(5)) == fuzzer.grpc_payload(random.Random(5))
    grpc = [outcome(fields_from_proto, fuzzer.grpc_payload(random.Random(i))) for i in range(300)]
    http = []
    for i in range(300):
        body, headers = fuzzer.http_request(random.Random(i))
        ids = [v.decode("latin-1") for k, v in headers if k == "x-request-id"]
        http.append(outcome(fields_from_json, body, ids))
    for outcomes in (grpc, http):
        assert 0.1 < outcomes.count("job") / len(outcomes) < 0.5


def test_failures_are_internal_errors_only():
    assert is_failure("grpc", "UNKNOWN") and is_failure("grpc", "INTERNAL") and is_failure("http", "500")
    assert is_failure("http", "conn:RemoteDisconnected")
    assert not any(is_failure("grpc", s) for s in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED"))
    assert not any(is_failure("http", s) for s in ("200", "400", "401", "415", "429"))


def test_bidi_streams_open_with_a_config_mostly_and_every_message_is_bytes():
    fuzzer = Fuzzer(0)
    calls = [fuzzer.stream_messages(random.Random(i)) for i in range(200)]
    assert all(isinstance(m, bytes) for call in calls for m in call)
    assert 0.7 < sum(bool(call) and call[0][:1] == b"\x0a" for call in calls) / len(calls) < 0.95  # field 1: config
    assert is_failure("grpc-bidi", "INTERNAL") and not is_failure("grpc-list", "INVALID_ARGUMENT")

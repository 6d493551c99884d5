"""Error replies (`router.replies`, `router.ingress._failure`): each failure kind's status, a short
message without internals, the request id, and one log line (a traceback only for our own bug)."""

from __future__ import annotations

import json
import logging

import grpc
from ray.exceptions import RayActorError

from core.errors import InvalidArgumentError
from router.auth import QuotaExceeded, Unauthenticated
from router.deadlines import DeadlineUnmeetable
from router.ingress import _failure
from router.replies import http_error, log_failure, out_of_memory_message, out_of_memory_retry_s
from router.streams import AdmissionRejected, StreamFailed


def test_each_failure_kind_gets_its_status_and_a_short_message():
    cases = [
        (InvalidArgumentError("input", "must not be empty"), grpc.StatusCode.INVALID_ARGUMENT, 400),
        (Unauthenticated("authorization: unknown API key"), grpc.StatusCode.UNAUTHENTICATED, 401),
        (QuotaExceeded("key quota: over 10 requests/s", 0.3), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (AdmissionRejected(1.0), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (DeadlineUnmeetable("cannot start in time: 50 ms left"), grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (StreamFailed("detok replica 7f3a at /opt/x.py:12 raised KeyError"), grpc.StatusCode.INTERNAL, 500),
        (RayActorError(), grpc.StatusCode.INTERNAL, 500),
        (KeyError("bug"), grpc.StatusCode.INTERNAL, 500),
    ]
    for err, code, status in cases:
        failure, own = _failure(err)
        assert (failure.code, failure.http_status) == (code, status)
        assert len(failure.message) < 120 and "/opt" not in failure.message and "Actor" not in failure.message
        assert (own is err) == isinstance(err, KeyError)  # only our own bug logs a traceback


def test_http_error_carries_the_request_id_and_retry_hint():
    failure, _ = _failure(QuotaExceeded("key quota: over 10 requests/s", 2.4))
    response = http_error(failure, "req-9")
    body = json.loads(response.body)["error"]
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert body["request_id"] == "req-9" and body["message"].endswith("(request id req-9)")
    assert response.headers["x-request-id"] == "req-9"
    assert "x-request-id" not in http_error(failure, "req-9", echo_id=False).headers


def test_client_errors_log_one_line_and_our_bugs_their_traceback(caplog):
    with caplog.at_level(logging.INFO, logger="ray.serve.voxray"):
        failure, own = _failure(InvalidArgumentError("text", "must not be empty"))
        log_failure(failure, "r-1", "gRPC", own)
        bug = ZeroDivisionError("boom")
        failure, own = _failure(bug)
        log_failure(failure, "r-2", "HTTP", own)
    first, second = caplog.records
    assert first.getMessage() == "gRPC request r-1: INVALID_ARGUMENT text: must not be empty" and not first.exc_info
    assert second.levelno == logging.ERROR and second.exc_info[1] is bug


def test_a_stream_failed_by_out_of_memory_is_resource_exhausted_with_its_retry_hint():
    failure, own = _failure(StreamFailed(out_of_memory_message(1.5)))
    assert (failure.code, failure.http_status, failure.retry_after_s, own) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, 429, 1.5, None,
    )  # fmt: skip
    assert failure.message == "out of accelerator memory; retry after 1.5 s"
    assert http_error(failure, "req-oom").headers["Retry-After"] == "2"
    assert out_of_memory_retry_s("out of accelerator memory at /opt/x.py") is None  # only our own message

"""What a client gets for a failed request, and the one log line the server keeps of it.

The Router's methods map each failure to a `Failure` (a status and a short message naming the
field, never an internal repr) and answer it here: gRPC status details / HTTP JSON error, both
with the request id (also in the `x-request-id` trailer / header). Client errors log one line
without a stack; a failure of the Router's own code logs its traceback once, here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import grpc
from fastapi.responses import JSONResponse

logger = logging.getLogger("ray.serve.voxray")  # under Serve's logger: lines land in the replica's log file

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
}
HTTP_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 415: "invalid_request_error"}

# An LLM replica's Failed event for a stream an out-of-memory error failed, as the Router reads it:
# RESOURCE_EXHAUSTED / 429 with the retry hint (a stream event carries only its message).
OUT_OF_MEMORY = "out of accelerator memory"
_OUT_OF_MEMORY_MESSAGE = re.compile(re.escape(OUT_OF_MEMORY) + r"; retry after ([0-9]+(?:\.[0-9]+)?) s")


def out_of_memory_message(retry_after_s: float) -> str:
    """The message of the Failed event an LLM replica sends for a stream failed by out-of-memory."""
    return f"{OUT_OF_MEMORY}; retry after {retry_after_s:.1f} s"


def out_of_memory_retry_s(message: str) -> float | None:
    """The retry hint of an `out_of_memory_message`; None for any other message."""
    match = _OUT_OF_MEMORY_MESSAGE.fullmatch(message)
    return float(match[1]) if match else None


@dataclass(frozen=True)
class Failure:
    code: grpc.StatusCode
    message: str  # short and safe to send: names the field, never an internal repr
    param: str | None = None  # the field at fault (HTTP `error.param`)
    retry_after_s: float | None = None
    cause: str = ""  # for the log line only (e.g. a stage's failure message)

    @property
    def http_status(self) -> int:
        if self.param == "content-type":
            return 415
        return HTTP_STATUS.get(self.code, 500)

    @property
    def is_client_error(self) -> bool:
        return self.http_status < 500


def with_request_id(message: str, req_id: str) -> str:
    return f"{message} (request id {req_id})"


def log_failure(failure: Failure, req_id: str, protocol: str, err: BaseException | None = None) -> None:
    """One line per failed request; the traceback only for a failure of the Router's own code (`err`)."""
    line = f"{protocol} request {req_id}: {failure.code.name} {failure.message}"
    if failure.cause:
        line += f" ({failure.cause})"
    if failure.is_client_error:
        logger.info(line)
    else:
        logger.error(line, exc_info=err)


def http_error(failure: Failure, req_id: str, echo_id: bool = True) -> JSONResponse:
    """The JSON error; `echo_id`: add the X-Request-Id header (not when the HTTP proxy adds it)."""
    status = failure.http_status
    body = {
        "error": {
            "message": with_request_id(failure.message, req_id),
            "type": HTTP_ERROR_TYPE.get(status, "rate_limit_error" if status == 429 else "server_error"),
            "param": failure.param,
            "request_id": req_id,
        }
    }
    headers = {"X-Request-Id": req_id} if echo_id else {}
    if failure.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(failure.retry_after_s)))
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=status, headers=headers)

"""Errors raised for bad user input; every one names the offending field.

Engines, the router and the CLI raise `InvalidArgumentError`; ingress servicers map it to
gRPC INVALID_ARGUMENT / HTTP 400 with the field in the message.
"""

from __future__ import annotations

import pydantic


class InvalidArgumentError(ValueError):
    """A request field holds a value the server cannot serve."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def from_validation_error(err: pydantic.ValidationError, prefix: str = "") -> InvalidArgumentError:
    """Convert pydantic's first error into an InvalidArgumentError naming the field."""
    first = err.errors()[0]
    field = ".".join(str(part) for part in first.get("loc", ()) if part != "__root__")
    if prefix:
        field = f"{prefix}.{field}" if field else prefix
    return InvalidArgumentError(field or prefix or "request", first.get("msg", str(err)))

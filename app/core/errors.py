"""What the services refuse, and why, in terms of the request rather than of a protocol.

Services (tenants, directory, registry, billing) raise these; the HTTP layer turns each
kind into its status and OpenAI error body (app/api/errors.py), the admin UI into a page.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ErrorKind(enum.Enum):
    INVALID = "invalid"  # the request itself is wrong: a value, a reference, a state
    UNAUTHENTICATED = "unauthenticated"  # no usable credentials
    FORBIDDEN = "forbidden"  # the caller may not do this (a limit, a permission)
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # the request contradicts what exists (a taken name, a race)
    TOO_LARGE = "too_large"
    UNPROCESSABLE = "unprocessable"  # well-formed, but its content is refused
    UNAVAILABLE = "unavailable"  # nothing can serve it now; retry later


class ServiceError(Exception):
    """A refusal the caller caused or can retry. `param` names the offending field of the
    request, `code` is the machine-readable reason."""

    kind: ClassVar[ErrorKind]
    default_code: ClassVar[str | None] = None

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code


class InvalidInput(ServiceError):
    kind = ErrorKind.INVALID


class Unauthenticated(ServiceError):
    kind = ErrorKind.UNAUTHENTICATED


class Forbidden(ServiceError):
    kind = ErrorKind.FORBIDDEN


class NotFound(ServiceError):
    kind = ErrorKind.NOT_FOUND
    default_code = "not_found"


class Conflict(ServiceError):
    kind = ErrorKind.CONFLICT
    default_code = "conflict"


class TooLarge(ServiceError):
    kind = ErrorKind.TOO_LARGE


class Unprocessable(ServiceError):
    kind = ErrorKind.UNPROCESSABLE


class Unavailable(ServiceError):
    """Nothing can serve the request now; the same request may be retried as is after
    `retry_after_s` seconds."""

    kind = ErrorKind.UNAVAILABLE
    default_code = "overloaded"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: int,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s

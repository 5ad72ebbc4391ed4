"""OpenAI error bodies (`{"error": {message, type, param, code}}`) and exception handlers."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.core.errors import ErrorKind, ServiceError, Unavailable

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# Union members show up in pydantic error locations as type tags; they are not params.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "literal"})


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error the API answers (OpenAI's shape)."""

    error: ErrorInfo


class APIError(Exception):
    """An error the client caused (or must retry), rendered as OpenAI's error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        # What metrics call it, when the code alone is too coarse (which quota ran out).
        self.reason = reason or code or str(status_code)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    # NOTE: the same answer for a model that does not exist and one the caller may not
    # use, so that nobody can probe for other tenants' adapters.
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def overloaded(message: str, *, retry_after_s: int, code: str = "overloaded") -> APIError:
    return APIError(
        503,
        message,
        type=SERVER_ERROR,
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def server_error() -> APIError:
    return APIError(
        500, "The server had an error while processing your request.", type=SERVER_ERROR
    )


# The status of each kind of service refusal; their bodies are OpenAI's error bodies.
SERVICE_STATUS: dict[ErrorKind, int] = {
    ErrorKind.INVALID: 400,
    ErrorKind.UNAUTHENTICATED: 401,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.CONFLICT: 409,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.UNPROCESSABLE: 422,
    ErrorKind.UNAVAILABLE: 503,
}


def service_error(exc: ServiceError) -> APIError:
    """A service's refusal as the HTTP error it answers."""
    headers: dict[str, str] = {}
    if exc.kind is ErrorKind.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, Unavailable):
        headers["Retry-After"] = str(exc.retry_after_s)
    return APIError(
        SERVICE_STATUS[exc.kind],
        exc.message,
        type=SERVER_ERROR if exc.kind is ErrorKind.UNAVAILABLE else INVALID_REQUEST,
        param=exc.param,
        code=exc.code,
        headers=headers,
    )


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        exc.to_body().model_dump(), status_code=exc.status_code, headers=exc.headers
    )


def loc_to_param(loc: Sequence[str | int]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part == "body" and not param:
            continue
        elif not part.isidentifier() or part in _TYPE_TAGS or part[0].isupper():
            # A union member's tag: what follows describes that member, not the field.
            break
        else:
            param += f".{part}" if param else part
    return param or None


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The first pydantic error of a request body as a 400 with its `param`."""
    assert errors, "a validation error without errors"
    first = errors[0]
    kind = first.get("type", "")
    loc = tuple(first.get("loc", ()))
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "invalid JSON")
        return invalid_request(
            f"We could not parse the JSON body of your request ({detail}). "
            "Send a JSON object with Content-Type: application/json."
        )
    param = loc_to_param(loc)
    if param is None:
        return invalid_request("The request body must be a JSON object.")
    if kind == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param=param)
    detail = first.get("msg", "invalid")
    return invalid_request(f"Invalid value for '{param}': {detail}.", param=param)


def _http_exception_error(request: Request, exc: StarletteHTTPException) -> APIError:
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    else:
        message = str(exc.detail)
    kind = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
    return APIError(exc.status_code, message, type=kind, headers=exc.headers)


# Routes whose refusals count as rejected generation requests in the metrics.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def _observe_rejection(request: Request, exc: APIError) -> None:
    if request.url.path not in GENERATION_PATHS:
        return
    state = getattr(request.app.state, "loraplex", None)
    if state is None:
        return
    principal = getattr(request.state, "principal", None)
    tenant = None if principal is None else principal.tenant_id
    state.metrics.observe_rejection(tenant=tenant, reason=exc.reason)


def install_exception_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        _observe_rejection(request, exc)
        return error_response(exc)

    async def on_service_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServiceError)
        return await on_api_error(request, service_error(exc))

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc.errors()))

    async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(_http_exception_error(request, exc))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)


def internal_error_body() -> bytes:
    """Body of an unhandled exception's 500, written by the outermost middleware."""
    return json.dumps(server_error().to_body().model_dump()).encode()

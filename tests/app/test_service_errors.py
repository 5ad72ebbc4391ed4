"""Services' refusals (app.core.errors) answer as OpenAI error bodies with their status."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from app.api.errors import SERVICE_STATUS, install_exception_handlers, service_error
from app.core.errors import (
    Conflict,
    ErrorKind,
    Forbidden,
    InvalidInput,
    NotFound,
    ServiceError,
    TooLarge,
    Unauthenticated,
    Unavailable,
    Unprocessable,
)

REFUSALS: list[tuple[ServiceError, int, str, dict[str, str]]] = [
    (InvalidInput("Bad 'x'.", param="x"), 400, "invalid_request_error", {}),
    (Unauthenticated("No key.", code="invalid_api_key"), 401, "invalid_request_error",
     {"WWW-Authenticate": "Bearer"}),
    (Forbidden("Over the limit.", code="max_adapters_exceeded"), 403,
     "invalid_request_error", {}),
    (NotFound("No tenant with id 'ten_x'.", param="tenant_id"), 404, "invalid_request_error",
     {}),
    (Conflict("Taken.", param="name"), 409, "invalid_request_error", {}),
    (TooLarge("Too big.", code="archive_too_large"), 413, "invalid_request_error", {}),
    (Unprocessable("Bad weights.", param="file", code="invalid_adapter"), 422,
     "invalid_request_error", {}),
    (Unavailable("Retry shortly.", retry_after_s=7), 503, "server_error", {"Retry-After": "7"}),
]


def test_every_kind_has_a_status() -> None:
    assert set(SERVICE_STATUS) == set(ErrorKind)
    assert {type(exc).kind for exc, *_ in REFUSALS} == set(ErrorKind)


def test_default_codes() -> None:
    assert NotFound("x").code == "not_found"
    assert Conflict("x").code == "conflict"
    assert Unavailable("x", retry_after_s=1).code == "overloaded"
    assert InvalidInput("x").code is None
    assert InvalidInput("x", code="invalid_adapter_name").code == "invalid_adapter_name"


@pytest.mark.parametrize(("exc", "status", "kind", "headers"), REFUSALS,
                         ids=[type(r[0]).__name__ for r in REFUSALS])
def test_mapping(exc: ServiceError, status: int, kind: str, headers: dict[str, str]) -> None:
    error = service_error(exc)
    assert (error.status_code, error.type, error.message, error.param, error.code) == (
        status, kind, exc.message, exc.param, exc.code
    )
    assert error.headers == headers
    assert error.reason == (exc.code or str(status))


@pytest.mark.parametrize(("exc", "status", "kind", "headers"), REFUSALS,
                         ids=[type(r[0]).__name__ for r in REFUSALS])
async def test_raised_in_a_route(
    exc: ServiceError, status: int, kind: str, headers: dict[str, str]
) -> None:
    app = FastAPI()
    install_exception_handlers(app)

    @app.get("/refuse")
    async def refuse() -> None:
        raise exc

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/refuse")
    assert response.status_code == status
    assert response.json() == {"error": {
        "message": exc.message, "type": kind, "param": exc.param, "code": exc.code,
    }}
    for name, value in headers.items():
        assert response.headers[name] == value
    if "Retry-After" not in headers:
        assert "retry-after" not in response.headers

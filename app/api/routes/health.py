"""Operations: /health (process up), /ready (can take traffic), /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from app.api.errors import APIError
from app.api.openapi import BEARER_SCHEME, error_responses
from app.api.schemas.health import Health, Readiness
from app.api.state import AppState, AppStateDep

router = APIRouter(tags=["operations"])

# A dependency slower than this counts as down for /ready.
_CHECK_TIMEOUT_S = 2.0


@router.get(
    "/health",
    response_model=Health,
    responses={503: {"model": Health, "description": "The engine failed for good; the "
                     "process drains and exits so that its supervisor restarts it"}},
)
async def health(state: AppStateDep) -> JSONResponse:
    # NOTE: the liveness probe: a failed engine never recovers in this process.
    reason = state.engine.failure()
    if reason is not None:
        return JSONResponse({"status": "failed", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ok"})


def _ping_database(state: AppState) -> None:
    with state.db() as session:
        session.execute(text("SELECT 1"))


async def _check(name: str, checks: dict[str, str], probe: Awaitable[bool]) -> None:
    try:
        ok = await asyncio.wait_for(probe, _CHECK_TIMEOUT_S)
    except Exception:
        ok = False
    checks[name] = "ok" if ok else "unavailable"


async def _database_ok(state: AppState) -> bool:
    await asyncio.to_thread(_ping_database, state)
    return True


@router.get(
    "/ready",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Draining, starting, or a dependency "
                     "is down", "headers": {"Retry-After": {"schema": {"type": "integer"}}}}},
)
async def ready(state: AppStateDep) -> JSONResponse:
    # NOTE: 503 while draining, so that a load balancer stops routing here before
    # the listening socket closes.
    headers = {"Retry-After": str(state.settings.retry_after_s)}
    # NOTE: a failed engine is why the process drains (and then exits 1): "failed" says
    # so for as long as it still answers, not only until the drain begins.
    if state.engine.failure() is not None:
        return JSONResponse({"status": "failed"}, status_code=503, headers=headers)
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers=headers)
    if not state.engine.is_ready():
        return JSONResponse({"status": "starting"}, status_code=503, headers=headers)
    checks: dict[str, str] = {}
    await asyncio.gather(
        _check("database", checks, _database_ok(state)),
        _check("quotas", checks, state.limiter.ping()),
    )
    if all(v == "ok" for v in checks.values()):
        return JSONResponse({"status": "ready", "checks": checks})
    return JSONResponse(
        {"status": "degraded", "checks": checks}, status_code=503, headers=headers
    )


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses=error_responses(401),
    # The metrics token is optional (LORAPLEX_METRICS_TOKEN): none, or the bearer scheme.
    openapi_extra={"security": [{}, {BEARER_SCHEME: []}]},
)
async def metrics(request: Request, state: AppStateDep) -> Response:
    token = state.settings.metrics_token
    if token is not None:
        sent = request.headers.get("authorization", "")
        # NOTE: constant time, as for every other secret the app compares.
        if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            raise APIError(401, "GET /metrics needs the metrics token as a bearer token.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

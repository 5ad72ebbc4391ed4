"""Operations: /health (process up), /ready (can take traffic), /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from app.api.state import AppState, AppStateDep

router = APIRouter(tags=["operations"])

# A dependency slower than this counts as down for /ready.
_CHECK_TIMEOUT_S = 2.0


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


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


@router.get("/ready")
async def ready(state: AppStateDep) -> JSONResponse:
    # NOTE: 503 while draining, so that a load balancer stops routing here before
    # the listening socket closes.
    headers = {"Retry-After": str(state.settings.retry_after_s)}
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


@router.get("/metrics")
async def metrics(state: AppStateDep) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

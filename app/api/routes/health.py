"""Operations: /health (process up), /ready (can take traffic), /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from app.api.state import AppStateDep

router = APIRouter(tags=["operations"])


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(state: AppStateDep) -> JSONResponse:
    # NOTE: 503 while draining, so that a load balancer stops routing here before
    # the listening socket closes.
    if state.draining:
        status = "draining"
    elif not state.engine.is_ready():
        status = "starting"
    else:
        return JSONResponse({"status": "ready"})
    headers = {"Retry-After": str(state.settings.retry_after_s)}
    return JSONResponse({"status": status}, status_code=503, headers=headers)


@router.get("/metrics")
async def metrics(state: AppStateDep) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

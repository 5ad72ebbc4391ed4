"""Bodies of the operations routes: GET /health and GET /ready."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Health(BaseModel):
    status: Literal["ok", "failed"]  # failed: 503, the engine failed for good
    reason: str | None = None


class Readiness(BaseModel):
    # ready: 200; the others: 503
    status: Literal["ready", "draining", "failed", "starting", "degraded"]
    checks: dict[str, Literal["ok", "unavailable"]] | None = None  # database, quotas

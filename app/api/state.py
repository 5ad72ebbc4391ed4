"""What the routes share: the engine, the settings, the services and the drain flag."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from app.core.config import Settings
from app.metrics import Metrics
from engine.client import EngineClient

if TYPE_CHECKING:
    from app.directory import Directory
    from app.evals.service import EvalService
    from app.metering.recorder import UsageRecorder
    from app.quotas.base import QuotaLimiter
    from app.registry.service import AdapterRegistry


@dataclass(slots=True)
class AppState:
    engine: EngineClient
    settings: Settings
    metrics: Metrics
    # The service's database and what is kept of it in memory for the hot path.
    db: sessionmaker[Session]
    directory: Directory
    limiter: QuotaLimiter
    usage: UsageRecorder
    registry: AdapterRegistry
    evals: EvalService
    # `created` of the model cards: when this server started.
    started_at: int = field(default_factory=lambda: int(time.time()))
    # Set on SIGTERM: /ready answers 503 and new generation requests are refused.
    draining: bool = False


async def get_app_state(request: Request) -> AppState:
    state = request.app.state.loraplex
    assert isinstance(state, AppState), "create_app() sets app.state.loraplex"
    return state


AppStateDep = Annotated[AppState, Depends(get_app_state)]

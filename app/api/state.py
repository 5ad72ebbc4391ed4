"""What the routes share: the engine, the settings, the metrics and the drain flag."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from app.core.config import Settings
from app.metrics import Metrics
from engine.client import EngineClient


@dataclass(slots=True)
class AppState:
    engine: EngineClient
    settings: Settings
    metrics: Metrics
    # `created` of the model cards: when this server started.
    started_at: int = field(default_factory=lambda: int(time.time()))
    # Set on SIGTERM: /ready answers 503 and new generation requests are refused.
    draining: bool = False


def get_app_state(request: Request) -> AppState:
    state = request.app.state.loraplex
    assert isinstance(state, AppState), "create_app() sets app.state.loraplex"
    return state


AppStateDep = Annotated[AppState, Depends(get_app_state)]

"""The FastAPI application: OpenAI-compatible routes in front of an EngineClient."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI

from app.api.errors import install_exception_handlers
from app.api.middleware import RequestContextMiddleware
from app.api.routes import chat, completions, health, models
from app.api.state import AppState
from app.core.config import Settings
from app.metrics import Metrics
from engine.client import EngineClient


def _version() -> str:
    try:
        return version("loraplex")
    except PackageNotFoundError:
        return "0.0.0"


def create_app(engine: EngineClient, settings: Settings) -> FastAPI:
    """Build the app around an engine that is already started; the caller shuts it down."""
    state = AppState(engine=engine, settings=settings, metrics=Metrics(engine))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.draining = True

    app = FastAPI(title="loraplex", version=_version(), lifespan=lifespan)
    app.state.loraplex = state
    install_exception_handlers(app)
    app.add_middleware(
        RequestContextMiddleware, max_body_bytes=settings.max_body_bytes, metrics=state.metrics
    )
    for module in (completions, chat, models, health):
        app.include_router(module.router)
    return app


def begin_drain(app: FastAPI) -> None:
    """From now on /ready answers 503 and new generation requests get 503 + Retry-After."""
    state = app.state.loraplex
    assert isinstance(state, AppState)
    state.draining = True

"""The FastAPI application: OpenAI-compatible and admin routes in front of an EngineClient,
with the service's database, key directory, quota limiter, usage recorder and registry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from sqlalchemy import Engine

from app.api.errors import install_exception_handlers
from app.api.middleware import RequestContextMiddleware
from app.api.openapi import install_openapi
from app.api.routes import (
    adapters,
    admin_engine,
    admin_tenants,
    billing,
    chat,
    completions,
    dynamic_lora,
    health,
    models,
    responses,
    usage,
)
from app.api.state import AppState
from app.core.config import Settings
from app.db import make_engine, prepare_database, session_factory
from app.directory import Directory
from app.evals.service import EvalService
from app.metering.recorder import UsageRecorder
from app.metering.reports import tokens_since
from app.metrics import Metrics
from app.quotas import InMemoryLimiter, make_limiter
from app.registry.service import AdapterRegistry
from engine.client import EngineClient

logger = logging.getLogger(__name__)


def _version() -> str:
    try:
        return version("loraplex")
    except PackageNotFoundError:
        return "0.0.0"


@dataclass(frozen=True, slots=True)
class Mount:
    """Routes served beside the API by another package (the admin UI), passed to
    create_app by whoever assembles the service (server_options.installed_mounts)."""

    name: str
    install: Callable[[FastAPI], None]  # called once the API's routes and handlers are in
    upload_paths: frozenset[str] = frozenset()  # streamed uploads: no general body limit


def create_app(
    engine: EngineClient, settings: Settings, *, mounts: Sequence[Mount] = ()
) -> FastAPI:
    """Build the app around an engine that is already started; the caller shuts it down.

    The database is opened (and an embedded SQLite one upgraded) here; background work
    (key refresh, usage writer, engine registration of adapters) runs while the app's
    lifespan does. `mounts` add their routes after the API's.
    """
    db_engine = make_engine(settings.resolved_database_url)
    try:
        prepare_database(db_engine)
    except BaseException:
        db_engine.dispose()
        raise
    db = session_factory(db_engine)
    directory = Directory(
        db,
        secret=settings.resolved_secret_key(),
        admin_key=settings.admin_key,
        refresh_interval_s=settings.refresh_interval_s,
    )
    directory.load()
    metrics = Metrics(engine, adapter_names=directory.model_name)
    registry = AdapterRegistry(db, engine, settings)
    state = AppState(
        engine=engine,
        settings=settings,
        metrics=metrics,
        db=db,
        directory=directory,
        limiter=make_limiter(
            settings.redis_url,
            mode=settings.quota_failure_mode,
            lease_ttl_s=settings.lease_ttl_s,
            timeout_s=settings.quota_redis_timeout_s,
            on_fail_open=metrics.observe_quota_fail_open,
        ),
        usage=UsageRecorder(
            db,
            settings.data_dir / "spool" / "usage",
            batch_size=settings.usage_batch_size,
            flush_interval_s=settings.usage_flush_interval_s,
            on_db_error=metrics.observe_usage_db_error,
        ),
        registry=registry,
        evals=EvalService(db, engine, registry, directory.ready_ref,
                          on_promoted=directory.refresh_after_write),
    )
    metrics.watch_services(state.usage, directory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _start_services(state)
        try:
            yield
        finally:
            state.draining = True
            await _stop_services(state, db_engine)

    app = FastAPI(title="loraplex", version=_version(), lifespan=lifespan)
    app.state.loraplex = state
    install_exception_handlers(app)
    install_openapi(app)
    app.add_middleware(
        RequestContextMiddleware,
        max_body_bytes=settings.max_body_bytes,
        metrics=state.metrics,
        unlimited_paths=adapters.UPLOAD_PATHS.union(*(m.upload_paths for m in mounts)),
    )
    _include_api_routes(app)
    for mount in mounts:
        mount.install(app)
    return app


def _include_api_routes(app: FastAPI) -> None:
    for module in (
        completions, chat, responses, models, health, adapters, admin_tenants, usage,
        admin_engine, billing, dynamic_lora,
    ):
        app.include_router(module.router)


def openapi_document() -> dict[str, Any]:
    """The app's OpenAPI document, built without a service behind it (for client
    generators and fuzzers that need it before any server runs)."""
    app = FastAPI(title="loraplex", version=_version())
    _include_api_routes(app)
    install_openapi(app)
    return app.openapi()


async def _start_services(state: AppState) -> None:
    if isinstance(state.limiter, InMemoryLimiter):
        await asyncio.to_thread(_seed_monthly_counters, state)
    state.usage.start()
    await state.registry.start()
    state.directory.add_listener(state.registry.on_versions_changed)
    await state.directory.start()


def _seed_monthly_counters(state: AppState) -> None:
    """Without Redis, the month's counters live in this process: start them from the
    usage rows, so that a restart does not hand every tenant a fresh monthly quota."""
    month_start = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    assert isinstance(state.limiter, InMemoryLimiter)
    try:
        with state.db() as session:
            used = tokens_since(session, month_start)
    except Exception:
        logger.exception("could not read this month's usage; monthly quotas start from zero")
        return
    for tenant_id, tokens in used.items():
        state.limiter.seed_monthly(tenant_id, tokens)


async def _stop_services(state: AppState, db_engine: Engine) -> None:
    # NOTE: in this order: nothing new is registered or refreshed, then the usage of
    # every finished request reaches the database (or the durable spool).
    await state.directory.stop()
    await state.evals.stop()
    await state.registry.stop()
    await asyncio.to_thread(state.usage.close)
    await state.limiter.close()
    db_engine.dispose()


def begin_drain(app: FastAPI) -> None:
    """From now on /ready answers 503 and new generation requests get 503 + Retry-After."""
    state = app.state.loraplex
    assert isinstance(state, AppState)
    state.draining = True

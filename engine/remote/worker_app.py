"""A worker's internal HTTP API around one engine (see protocol.py for the wire format).

Every `/internal/*` route needs `Authorization: Bearer <LORAPLEX_WORKER_TOKEN>`;
`/health`, `/ready` and `/metrics` answer anyone, as the gateway's do (probes and
Prometheus), and say nothing about tenants.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.client import EngineClient
from engine.errors import AdapterError, AdapterUnavailable, EngineUnavailable
from engine.remote.protocol import (
    ABORT_PATH,
    ADAPTERS_PATH,
    GENERATE_PATH,
    KEEPALIVE,
    NDJSON,
    REMOVE_ADAPTER_PATH,
    STATS_PATH,
    AbortRequest,
    AdapterList,
    AddAdapterRequest,
    ErrorBody,
    RemoveAdapterRequest,
    RemoveAdapterResponse,
    WireError,
    WorkerStats,
    decode_request,
    encode_adapter_info,
    encode_error,
    encode_output,
    refusal,
)
from engine.request import RequestOutput

log = logging.getLogger("loraplex.worker")

# While a request produces nothing (queued, loading its adapter), a keepalive line goes
# out this often; gateways give up on a stream silent for a few times as long.
DEFAULT_KEEPALIVE_S = 5.0
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class WorkerError(Exception):
    """An answer other than 2xx, with the wire's error body."""

    def __init__(self, status_code: int, error: WireError) -> None:
        super().__init__(error.message)
        self.status_code = status_code
        self.error = error


@dataclass(slots=True)
class WorkerState:
    engine: EngineClient
    token: str | None  # None: no authentication (loopback only, see the CLI)
    data_dir: Path  # resolved
    render_metrics: Callable[[], bytes] | None = None
    keepalive_s: float = DEFAULT_KEEPALIVE_S
    # An adapter directory of the store that is not on this machine: fetch it (the last
    # path component, its content address) and return where it landed; AdapterError when
    # it cannot be served, EngineUnavailable when the store cannot be reached. None: the
    # data directory is the store.
    fetch_adapter: Callable[[str], Path] | None = None
    # Set on SIGTERM: new generations get 503 (gateways retry them elsewhere).
    draining: bool = False

    @property
    def adapter_store(self) -> Path:
        return self.data_dir / "adapters"


def resolve_adapter_path(data_dir: Path, raw: str) -> Path:
    """The adapter directory a gateway named: relative to the data directory or absolute,
    and, once symlinks are resolved, inside the adapter store; WorkerError otherwise."""
    store = (data_dir / "adapters").resolve()
    path = Path(raw)
    full = (path if path.is_absolute() else data_dir / path).resolve()
    if full == store or not full.is_relative_to(store):
        raise WorkerError(
            400,
            WireError(
                kind="invalid",
                code="path_outside_store",
                param="path",
                message="the adapter directory is outside this worker's adapter store "
                "(<LORAPLEX_DATA_DIR>/adapters/): gateways and workers must share "
                "LORAPLEX_DATA_DIR",
            ),
        )
    return full


def get_state(request: Request) -> WorkerState:
    state = request.app.state.worker
    assert isinstance(state, WorkerState), "create_worker_app() sets app.state.worker"
    return state


StateDep = Annotated[WorkerState, Depends(get_state)]


def require_token(state: StateDep, authorization: Annotated[str | None, Header()] = None) -> None:
    if state.token is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    # NOTE: compare_digest, so that the time taken says nothing about the token.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), state.token.encode()
    ):
        raise WorkerError(
            401, WireError(kind="unauthorized", message="missing or wrong worker token")
        )


def create_worker_app(
    engine: EngineClient,
    *,
    token: str | None,
    data_dir: Path,
    render_metrics: Callable[[], bytes] | None = None,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    fetch_adapter: Callable[[str], Path] | None = None,
) -> FastAPI:
    """The internal API of a started engine; the caller shuts the engine down."""
    state = WorkerState(
        engine=engine,
        token=token,
        data_dir=data_dir.resolve(),
        render_metrics=render_metrics,
        keepalive_s=keepalive_s,
        fetch_adapter=fetch_adapter,
    )
    app = FastAPI(title="loraplex worker", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = state
    app.add_exception_handler(WorkerError, _worker_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.include_router(_operations())
    app.include_router(_internal(), dependencies=[Depends(require_token)])
    return app


def begin_drain(app: FastAPI) -> None:
    get_state_of(app).draining = True


def get_state_of(app: FastAPI) -> WorkerState:
    state = app.state.worker
    assert isinstance(state, WorkerState)
    return state


async def _worker_error(request: Request, exc: WorkerError) -> JSONResponse:
    return JSONResponse(ErrorBody(error=exc.error).model_dump(), status_code=exc.status_code)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    error = WireError(kind="invalid", message=f"malformed request: {exc.errors()}")
    return JSONResponse(ErrorBody(error=error).model_dump(), status_code=422)


def _unavailable(message: str) -> WorkerError:
    return WorkerError(503, WireError(kind="unavailable", message=message))


# ----------------------------------------------------------------------------- routes


def _operations() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(state: StateDep) -> JSONResponse:
        reason = state.engine.failure()
        if reason is not None:  # the liveness probe: this process exits and is restarted
            return JSONResponse({"status": "failed", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/ready")
    async def ready(state: StateDep) -> JSONResponse:
        if state.engine.failure() is not None:
            return JSONResponse({"status": "failed"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.engine.is_ready():
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @router.get("/metrics")
    async def metrics(state: StateDep) -> Response:
        if state.render_metrics is None:
            return Response(status_code=404)
        return Response(state.render_metrics(), media_type=_PROMETHEUS_TEXT)

    return router


def _internal() -> APIRouter:
    router = APIRouter()

    @router.post(GENERATE_PATH)
    async def generate(request: Request, state: StateDep) -> Response:
        try:
            engine_request = decode_request(await request.body())
        except ValidationError as exc:
            reason = refusal(exc)
            if reason is None:
                error = WireError(kind="invalid", message=f"malformed request: {exc.errors()}")
                raise WorkerError(422, error) from None
            raise WorkerError(400, WireError(kind="invalid", message=reason)) from None
        if state.draining:
            raise _unavailable("the worker is shutting down")
        if not state.engine.is_ready():
            raise _unavailable("the engine is not ready")
        outputs = state.engine.generate(engine_request)
        return NdjsonStreamResponse(_stream_lines(outputs, state.keepalive_s))

    @router.post(ABORT_PATH)
    async def abort(body: AbortRequest, state: StateDep) -> dict[str, bool]:
        state.engine.abort(body.request_id)
        return {"ok": True}

    @router.get(ADAPTERS_PATH)
    async def list_adapters(state: StateDep) -> AdapterList:
        return AdapterList(adapters=state.engine.list_adapters())

    @router.post(ADAPTERS_PATH)
    async def add_adapter(body: AddAdapterRequest, state: StateDep) -> Response:
        path = resolve_adapter_path(state.data_dir, body.path)
        existing = state.engine.get_adapter(body.name)
        # Idempotent: every gateway registers what its directory reports.
        if existing is not None and existing.path is not None and Path(existing.path) == path:
            return Response(encode_adapter_info(existing), media_type="application/json")
        try:
            if state.fetch_adapter is not None and not path.is_dir():
                path = await asyncio.to_thread(state.fetch_adapter, path.name)
            info = await state.engine.add_adapter(body.name, str(path))
        except EngineUnavailable as exc:
            raise WorkerError(503, WireError(
                kind="unavailable", code=AdapterUnavailable.code, param="path",
                message=f"the adapter's files cannot be fetched from the adapter store: {exc}",
            )) from None
        except AdapterError as exc:
            error = WireError(kind="invalid", code="invalid_adapter", param="path",
                              message=str(exc))
            raise WorkerError(422, error) from None
        return Response(encode_adapter_info(info), media_type="application/json")

    @router.post(REMOVE_ADAPTER_PATH)
    async def remove_adapter(body: RemoveAdapterRequest, state: StateDep) -> RemoveAdapterResponse:
        return RemoveAdapterResponse(removed=await state.engine.remove_adapter(body.name))

    @router.get(STATS_PATH)
    async def stats(state: StateDep) -> WorkerStats:
        engine = state.engine
        return WorkerStats(
            model_id=engine.model_id,
            max_model_len=engine.max_model_len,
            ready=engine.is_ready() and not state.draining,
            draining=state.draining,
            stats=engine.stats(),
            residency=engine.adapter_residency(),
        )

    return router


# ----------------------------------------------------------------------------- streaming


async def _stream_lines(
    outputs: AsyncIterator[RequestOutput], keepalive_s: float
) -> AsyncGenerator[bytes, None]:
    """The engine's outputs as lines, a keepalive line while there is none for a while,
    and an error line if the engine raises. Closing this closes (aborts) the request."""
    pending: asyncio.Future[RequestOutput] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(_next(outputs))
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                out = task.result()
            except StopAsyncIteration:
                return
            except Exception as exc:
                if not isinstance(exc, ValueError):
                    log.error("engine request failed", exc_info=exc)
                yield encode_error(WireError.of(exc))
                return
            yield encode_output(out)
            if out.finished:
                return
    finally:
        if pending is not None:
            # The generator cannot be closed while a step of it runs: cancel that first.
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()


async def _next(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await outputs.__anext__()


class NdjsonStreamResponse(StreamingResponse):
    """Streams lines and closes the body (aborting the engine request) the moment the
    gateway's connection drops, even while no line is due."""

    def __init__(self, body: AsyncGenerator[bytes, None]) -> None:
        super().__init__(body, media_type=NDJSON)
        self._lines = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self._lines:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        pump_task = asyncio.ensure_future(pump())
        watch_task = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump_task, watch_task):
                task.cancel()
            await asyncio.gather(pump_task, watch_task, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._lines.aclose()

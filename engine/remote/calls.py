"""Calls to one worker's internal API, and what their failures mean for the caller:
the request's own fault (raised as the engine would raise it), or this worker's
(`WorkerFailed`: another worker may take the request)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from engine.client import AdapterInfo
from engine.remote.protocol import (
    ADAPTERS_PATH,
    GENERATE_PATH,
    ErrorBody,
    WireError,
    decode_adapter_info,
    decode_line,
)
from engine.remote.workers import KnownWorker
from engine.request import RequestOutput

log = logging.getLogger("loraplex.gateway")


class WorkerFailed(Exception):
    """This worker cannot run the request now; another one may."""

    def __init__(self, message: str, *, suspend: bool, code: str | None = None) -> None:
        super().__init__(message)
        self.suspend = suspend  # take the worker out of rotation
        self.code = code  # the worker's error code, where it gave one


class AdapterMissing(Exception):
    """The worker does not serve the adapter the request names."""


class AdapterRefused(Exception):
    """The worker's validation refused the adapter (or its path)."""


async def stream_generate(
    http: httpx.AsyncClient, worker: KnownWorker, body: bytes
) -> AsyncGenerator[RequestOutput, None]:
    """The outputs of one generation on `worker`. Closing the generator closes the
    connection, which aborts the request on the worker."""
    try:
        async with http.stream("POST", worker.url + GENERATE_PATH, content=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise call_failure(worker, response)
            async for line in response.aiter_lines():
                if not line:
                    continue  # keepalive
                try:
                    item = decode_line(line)
                except ValueError as exc:  # another version, or a broken worker
                    raise WorkerFailed(f"unreadable stream: {exc}", suspend=True) from None
                if isinstance(item, WireError):
                    raise _stream_failure(item)
                yield item
                if item.finished:
                    return
            raise WorkerFailed("the stream ended before the request finished", suspend=True)
    except httpx.TransportError as exc:
        raise WorkerFailed(describe(exc), suspend=True) from exc


async def register_adapter(
    http: httpx.AsyncClient, worker: KnownWorker, name: str, path: str
) -> AdapterInfo:
    """Validate and serve an adapter on `worker` (a no-op if it serves that directory
    under that name already). AdapterRefused, WorkerFailed."""
    try:
        response = await http.post(worker.url + ADAPTERS_PATH, json={"name": name, "path": path})
    except httpx.TransportError as exc:
        raise WorkerFailed(describe(exc), suspend=True) from exc
    if response.status_code in (400, 422):
        raise AdapterRefused(error_of(response).message)
    if response.status_code != 200:
        raise call_failure(worker, response)
    info = decode_adapter_info(response.content)
    worker.registered.add(name)
    log.info("adapter %s registered on worker %s", name, worker.worker_id)
    return info


async def post(
    http: httpx.AsyncClient, worker: KnownWorker, path: str, body: dict[str, Any]
) -> None:
    response = await http.post(worker.url + path, json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{path} on {worker.worker_id}: {error_of(response).message}")


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def error_of(response: httpx.Response) -> WireError:
    try:
        return ErrorBody.model_validate_json(response.content).error
    except ValueError:
        return WireError(kind="engine", message=f"HTTP {response.status_code}")


def call_failure(worker: KnownWorker, response: httpx.Response) -> Exception:
    """A non-2xx answer: the request's own fault raises as the engine would; a worker
    that cannot take work is skipped (and, when misconfigured or broken, suspended)."""
    error = error_of(response)
    if response.status_code in (400, 422) and error.kind in ("rejected", "invalid"):
        return error.to_exception()
    if response.status_code == 401:
        log.error("worker %s refused this gateway's token (LORAPLEX_WORKER_TOKEN differs)",
                  worker.worker_id)
    suspend = response.status_code != 503  # 503: draining or starting; its beat says so
    return WorkerFailed(f"HTTP {response.status_code}: {error.message}", suspend=suspend,
                        code=error.code)


def _stream_failure(error: WireError) -> Exception:
    if error.kind == "rejected" and error.code == "model_not_found":
        return AdapterMissing(error.message)
    if error.kind in ("rejected", "invalid"):
        return error.to_exception()
    return WorkerFailed(error.message, suspend=error.kind != "unavailable")

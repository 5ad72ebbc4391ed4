"""What the engine's failures look like to an OpenAI client: one mapping, one place."""

from __future__ import annotations

import logging

from app.api.errors import (
    SERVER_ERROR,
    APIError,
    invalid_request,
    model_not_found,
    overloaded,
    server_error,
)
from engine.errors import (
    AdapterUnavailable,
    EngineDeadError,
    EngineStepError,
    NoWorkerAvailable,
    RequestRejected,
    WorkerLost,
)

logger = logging.getLogger(__name__)


def generation_timeout() -> APIError:
    return APIError(504, "The request timed out before generation finished.", type=SERVER_ERROR,
                    code="timeout")


def no_worker(retry_after_s: int) -> APIError:
    return overloaded(
        "No engine worker can take this request right now; retry shortly.",
        retry_after_s=retry_after_s,
    )


def worker_lost() -> APIError:
    return APIError(
        502, "The engine worker running this request failed; retry the request.",
        type=SERVER_ERROR, code="worker_lost",
    )


def aborted_by_server() -> APIError:
    return APIError(
        503, "The server aborted the request (shutting down); retry it.", type=SERVER_ERROR,
        code="overloaded",
    )


def rejected(exc: RequestRejected, *, model: str | None) -> APIError:
    """A request the engine (or its limits, applied while planning) can never serve."""
    if exc.code == "model_not_found" and model is not None:
        return model_not_found(model)  # an adapter removed since planning
    return invalid_request(str(exc), param=exc.param, code=exc.code)


def api_error_of(
    exc: BaseException, *, model: str, request_id: str, draining: bool, retry_after_s: int
) -> APIError:
    """The error body a client gets for an engine request that raised `exc`.

    `model` is the name the client asked for (an adapter removed since planning is a 404
    for it); `request_id` names the engine request in the log.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestRejected):
        return rejected(exc, model=model)
    if isinstance(exc, AdapterUnavailable):
        logger.warning("engine request %s: %s", request_id, exc)
        return overloaded(
            f"The adapter '{model}' cannot be fetched from the adapter store right now; "
            "retry shortly.", retry_after_s=retry_after_s, code=AdapterUnavailable.code,
        )
    if isinstance(exc, NoWorkerAvailable):
        return no_worker(retry_after_s)
    if isinstance(exc, WorkerLost):
        logger.warning("engine request %s: %s", request_id, exc)
        return worker_lost()
    if isinstance(exc, ValueError):
        return invalid_request(str(exc))
    # NOTE: a step that failed on this request, or the engine failing for good under it,
    # is a 500 even though the drain has begun since (that failure is what starts it):
    # retrying it elsewhere is the client's call, not a shutdown's.
    failed = isinstance(exc, EngineStepError) or (
        isinstance(exc, EngineDeadError) and exc.failure is not None
    )
    if draining and not failed:
        return aborted_by_server()
    logger.error("engine request %s failed", request_id, exc_info=exc)
    return server_error()

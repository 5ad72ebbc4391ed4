"""Running a plan's engine requests, and stopping them the moment nobody waits for them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from app.api.accounting import open_account
from app.api.errors import (
    SERVER_ERROR,
    APIError,
    invalid_request,
    model_not_found,
    overloaded,
    server_error,
)
from app.api.serving import GenerationPlan, check_admission
from app.api.state import AppState
from app.models import Isolation, UsageStatus
from engine.client import RequestRejected
from engine.remote.client import RemoteEngine, Route
from engine.remote.protocol import WORKER_HEADER, NoWorkerAvailable, WorkerLost
from engine.request import RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The client closed the connection; nobody reads a response with this status.
CLIENT_CLOSED_REQUEST = 499


@dataclass(slots=True)
class ChoiceResult:
    """Everything one choice produced so far."""

    text_parts: list[str] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_time: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, output: RequestOutput) -> None:
        if output.new_token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.text_parts.append(output.new_text)
        self.token_texts.extend(output.new_token_texts)
        self.logprobs.extend(output.new_logprobs)
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_output_tokens = output.num_output_tokens
        self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finish_reason = output.finish_reason


def generation_timeout() -> APIError:
    return APIError(504, "The request timed out before generation finished.", type=SERVER_ERROR,
                    code="timeout")


def no_worker(state: AppState) -> APIError:
    return overloaded(
        "No engine worker can take this request right now; retry shortly.",
        retry_after_s=state.settings.retry_after_s,
    )


def worker_lost() -> APIError:
    return APIError(
        502, "The engine worker running this request failed; retry the request.",
        type=SERVER_ERROR, code="worker_lost",
    )


def route_plan(state: AppState, plan: GenerationPlan) -> Route | None:
    """With the engine on workers: choose the worker now, so that the response (whose
    headers go out before the first token) can name it. None for an in-process engine."""
    engine = state.engine
    if not isinstance(engine, RemoteEngine):
        return None
    tenant = plan.principal.tenant
    try:
        return engine.route(
            [plan.engine_request_id(i) for i in range(plan.num_choices)],
            adapter_id=plan.adapter_id,
            tenant_id=None if tenant is None else tenant.id,
            tenant_name=None if tenant is None else tenant.name,
            dedicated=tenant is not None and tenant.isolation == Isolation.DEDICATED,
        )
    except NoWorkerAvailable as exc:
        raise no_worker(state) from exc


def aborted_by_server() -> APIError:
    return APIError(
        503, "The server aborted the request (shutting down); retry it.", type=SERVER_ERROR,
        code="overloaded",
    )


async def run_choices(
    state: AppState, plan: GenerationPlan, results: list[ChoiceResult]
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Yield (choice index, output) until every choice has finished, filling `results`.

    Closing this generator early (client gone, timeout) closes the engine iterators,
    which aborts their requests and frees their KV blocks at once.
    """
    assert len(results) == plan.num_choices
    account = plan.account
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(index: int) -> None:
        stream: AsyncIterator[RequestOutput] | None = None
        try:
            stream = state.engine.generate(
                plan.engine_request_id(index),
                plan.prompt_of(index),
                plan.sampling[index],
                adapter_id=plan.adapter_id,
                salt=plan.salt,
                priority=plan.priority,
                tenant=plan.engine_tenant,
            )
            async for output in stream:
                queue.put_nowait((index, output))
                if output.finished:
                    return
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    if account is not None:
        account.engine_started = time.monotonic()
    tasks = [asyncio.create_task(pump(i)) for i in range(plan.num_choices)]
    deadline = plan.arrival + state.settings.request_timeout_s
    num_open = plan.num_choices
    # Until every choice has finished, an exit means the client went away.
    status = UsageStatus.ABORTED
    try:
        while num_open:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise generation_timeout()
            # NOTE: asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a
            # cancellation that arrives as the queue hands over an item, and the request
            # of a client that left would then run to its end.
            try:
                async with asyncio.timeout(remaining):
                    index, item = await queue.get()
            except TimeoutError:
                raise generation_timeout() from None
            if isinstance(item, RequestRejected) and item.code == "model_not_found":
                raise model_not_found(plan.model) from item  # removed since planning
            if isinstance(item, RequestRejected):
                raise invalid_request(str(item), param=item.param, code=item.code) from item
            if isinstance(item, NoWorkerAvailable):
                raise no_worker(state) from item
            if isinstance(item, WorkerLost):
                logger.warning("engine request %s: %s", plan.engine_request_id(index), item)
                raise worker_lost() from item
            if isinstance(item, ValueError):
                raise invalid_request(str(item)) from item
            if isinstance(item, BaseException) and state.draining:
                raise aborted_by_server() from item
            if isinstance(item, BaseException):
                logger.error("engine request %s failed", plan.engine_request_id(index),
                             exc_info=item)
                raise server_error() from item
            results[index].add(item)
            if item.finished:
                num_open -= 1
                _observe(state, plan, index, results[index])
                if item.finish_reason == "abort":
                    raise aborted_by_server()
                if not num_open and account is not None:
                    account.engine_finished = time.monotonic()
            yield index, item
        status = UsageStatus.OK
    except APIError as exc:
        # A drain that aborts the request bills it like a client that left.
        status = UsageStatus.ABORTED if exc.code == "overloaded" else UsageStatus.ERROR
        raise
    except Exception:
        status = UsageStatus.ERROR
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for index, result in enumerate(results):
            if result.finish_reason is None:
                result.finish_reason = "abort"
                _observe(state, plan, index, result)
        if account is not None:
            account.close(status, results)


def _observe(state: AppState, plan: GenerationPlan, index: int, result: ChoiceResult) -> None:
    assert result.finish_reason is not None
    state.metrics.observe_request(
        arrival=plan.arrival,
        first_token=result.first_token_time,
        finished=time.monotonic(),
        num_prompt_tokens=result.num_prompt_tokens or len(plan.prompt_of(index)),
        num_output_tokens=result.num_output_tokens,
        finish_reason=result.finish_reason,
        model=plan.adapter_id or state.engine.model_id,
    )


async def collect(state: AppState, plan: GenerationPlan) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(plan.num_choices)]
    stream = run_choices(state, plan, results)
    try:
        async for _ in stream:
            pass
    finally:
        await stream.aclose()
    return results


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`, cancelling it as soon as the client hangs up (then None)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch_task):
            task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if work_task.cancelled():
        return None
    return work_task.result()


async def serve_generation(
    request: Request,
    state: AppState,
    plan: GenerationPlan,
    respond: Callable[[AppState, GenerationPlan], Awaitable[BaseModel]],
    stream: Callable[[AppState, GenerationPlan], AsyncIterator[bytes]],
) -> Response:
    """Admit the plan against its tenant's quotas, then run it as one response or a stream.

    However the request ends (finished, failed, client gone before or while it ran), its
    account is closed exactly once: quota settled, usage recorded.
    """
    check_admission(state, plan.num_choices)
    route = route_plan(state, plan)
    try:
        account = await open_account(state, plan)
    except BaseException:
        if route is not None:
            assert isinstance(state.engine, RemoteEngine)
            state.engine.release([plan.engine_request_id(i) for i in range(plan.num_choices)])
        raise
    plan.account = account
    headers = dict(account.headers)
    if route is not None:
        headers[WORKER_HEADER] = route.worker_id

    def close_unstarted() -> None:
        # A no-op when the request ran: run_choices closed the account with its outcome.
        account.close(UsageStatus.ABORTED, [])

    if plan.stream:
        return EventStreamResponse(stream(state, plan), headers=headers, on_close=close_unstarted)
    try:
        result = await unless_disconnected(request, respond(state, plan))
    finally:
        close_unstarted()
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if route is not None:
        headers[WORKER_HEADER] = route.worker_id  # where it ran, after any retry
    return Response(result.model_dump_json(), media_type="application/json", headers=headers)


class EventStreamResponse(StreamingResponse):
    """SSE response that stops its body the moment the client disconnects.

    NOTE: Starlette's StreamingResponse notices a disconnect only on its next write
    under ASGI 2.4; a request still waiting for its first token would keep its engine
    slot. Here a listener always runs, and the body iterator is closed in any case.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            content,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._body = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream_task = asyncio.ensure_future(self.stream_response(send))
        watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream_task, watch_task):
                task.cancel()
            await asyncio.gather(stream_task, watch_task, return_exceptions=True)
            aclose = getattr(self._body, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                self._on_close()
        if stream_task.cancelled():
            return
        exc = stream_task.exception()
        if exc is not None and not isinstance(exc, OSError):  # OSError: client gone mid-write
            raise exc


def sse_event(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(exc: APIError) -> bytes:
    return sse_event(exc.to_body().model_dump_json())


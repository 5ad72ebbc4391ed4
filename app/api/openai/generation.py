"""Serving a plan: admit it, run its engine requests, and hand what they produced to a
renderer; stop them the moment nobody waits for them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import Response

from app.api.engine_errors import aborted_by_server, api_error_of, generation_timeout, no_worker
from app.api.errors import APIError
from app.api.openai.accounting import RequestAccount, open_account
from app.api.openai.choices import ChoiceResult, new_results, usage_of
from app.api.openai.plan import GenerationPlan
from app.api.openai.planning import check_admission, wait_until_served
from app.api.openai.rendering import Renderer
from app.api.openai.streaming import CLIENT_CLOSED_REQUEST, EventStreamResponse, unless_disconnected
from app.api.state import AppState
from app.tables import UsageStatus
from engine.client import WORKER_HEADER, EngineClient, Route
from engine.errors import NoWorkerAvailable
from engine.request import EngineRequest, RequestOutput

_Item = tuple[int, RequestOutput | BaseException]


async def serve_generation(
    request: Request, state: AppState, plan: GenerationPlan, renderer: Renderer
) -> Response:
    """Admit the plan against its tenant's quotas, then run it as one response or a stream.

    However the request ends (finished, failed, client gone before or while it ran), its
    account is closed exactly once: quota settled, usage recorded.
    """
    check_admission(state, plan.num_choices)
    await wait_until_served(state, plan.target, plan.model)
    route = _route(state, plan)
    try:
        account = await open_account(state, plan)
    except BaseException:
        state.engine.release(plan.engine_request_ids)
        raise
    headers = dict(account.headers)
    if route is not None:
        headers[WORKER_HEADER] = route.worker_id

    def close_unstarted() -> None:
        # A no-op when the request ran: run_choices closed the account with its outcome.
        account.close(UsageStatus.ABORTED, [])

    if plan.stream:
        events = stream_events(state, plan, account, renderer)
        return EventStreamResponse(events, headers=headers, on_close=close_unstarted)
    try:
        results = await unless_disconnected(request, collect(state, plan, account))
    finally:
        close_unstarted()
    if results is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    body = renderer.response(results, usage_of(plan, results))
    if route is not None:
        headers[WORKER_HEADER] = route.worker_id  # where it ran, after any retry
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)


def _route(state: AppState, plan: GenerationPlan) -> Route | None:
    """With the engine on workers: choose the worker now, so that the response (whose
    headers go out before the first token) can name it. None for an in-process engine."""
    try:
        return state.engine.route(plan.engine_request_ids, plan.route_hint)
    except NoWorkerAvailable as exc:
        raise no_worker(state.settings.retry_after_s) from exc


async def collect(
    state: AppState, plan: GenerationPlan, account: RequestAccount
) -> list[ChoiceResult]:
    results = new_results(plan)
    stream = run_choices(state, plan, account, results)
    try:
        async for _ in stream:
            pass
    finally:
        await stream.aclose()
    return results


async def stream_events(
    state: AppState, plan: GenerationPlan, account: RequestAccount, renderer: Renderer
) -> AsyncIterator[bytes]:
    """The SSE body: the renderer's events for each output, to its last (or the error's)."""
    results = new_results(plan)
    outputs = run_choices(state, plan, account, results)
    try:
        for event in renderer.stream_start():
            yield event
        async for index, output in outputs:
            for event in renderer.stream_output(index, output):
                yield event
        for event in renderer.stream_end(usage_of(plan, results)):
            yield event
    except APIError as exc:
        for event in renderer.stream_error(exc):
            yield event
    finally:
        await outputs.aclose()


async def run_choices(
    state: AppState, plan: GenerationPlan, account: RequestAccount,
    results: Sequence[ChoiceResult],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Yield (choice index, output) until every choice has finished, filling `results`;
    then close the account with the outcome.

    Closing this generator early (client gone, timeout) closes the engine iterators,
    which aborts their requests and frees their KV blocks at once.
    """
    assert len(results) == plan.num_choices
    queue: asyncio.Queue[_Item] = asyncio.Queue()
    account.engine_started = time.monotonic()
    tasks = [
        asyncio.create_task(_pump(state.engine, plan.engine_request(i), i, queue))
        for i in range(plan.num_choices)
    ]
    deadline = plan.arrival + state.settings.request_timeout_s
    num_open = plan.num_choices
    # Until every choice has finished, an exit means the client went away.
    status = UsageStatus.ABORTED
    try:
        while num_open:
            index, item = await _next(queue, deadline)
            if isinstance(item, BaseException):
                raise api_error_of(
                    item, model=plan.model, request_id=plan.engine_request_id(index),
                    draining=state.draining, retry_after_s=state.settings.retry_after_s,
                ) from item
            results[index].add(item)
            if item.finished:
                num_open -= 1
                _observe(state, plan, index, results[index])
                if item.finish_reason == "abort":
                    raise aborted_by_server()
                if not num_open:
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
        account.close(status, results)


async def _pump(
    engine: EngineClient, request: EngineRequest, index: int, queue: asyncio.Queue[_Item]
) -> None:
    """Forward one engine request's outputs (or its error) to the queue."""
    stream: AsyncIterator[RequestOutput] | None = None
    try:
        stream = engine.generate(request)
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


async def _next(queue: asyncio.Queue[_Item], deadline: float) -> _Item:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise generation_timeout()
    # NOTE: asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation
    # that arrives as the queue hands over an item, and the request of a client that left
    # would then run to its end.
    try:
        async with asyncio.timeout(remaining):
            return await queue.get()
    except TimeoutError:
        raise generation_timeout() from None


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

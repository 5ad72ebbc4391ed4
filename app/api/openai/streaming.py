"""HTTP plumbing of generation responses: SSE framing, an event stream that stops the
moment its client disconnects, and running work only while the client waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.api.errors import APIError

T = TypeVar("T")

# The client closed the connection; nobody reads a response with this status.
CLIENT_CLOSED_REQUEST = 499


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`, cancelling it as soon as the client hangs up (then None)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch_task):
            task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if work_task.cancelled():
        return None
    return work_task.result()


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
        watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
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


"""Outermost ASGI middleware: request ids, the body size limit, last-resort 500s."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import SERVER_ERROR, APIError, error_response, internal_error_body
from app.metrics import Metrics

logger = logging.getLogger(__name__)

# A client's id is echoed only if it cannot smuggle anything into headers or logs.
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


class _BodyTooLarge(Exception):
    pass


def request_id_from(headers: Headers) -> str:
    sent = headers.get("x-request-id")
    if sent is not None and _SANE_REQUEST_ID.fullmatch(sent):
        return sent
    return uuid.uuid4().hex


class RequestContextMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware) so that streaming responses pass untouched."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        metrics: Metrics,
        unlimited_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        # Routes that stream their bodies to disk and enforce their own (larger) limit.
        self.unlimited_paths = unlimited_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = request_id_from(headers)
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        try:
            receive = await self._limit_body(scope, headers, receive)
            await self.app(scope, receive, send_with_id)
        except _BodyTooLarge:
            error = APIError(
                413,
                f"The request body is larger than the limit of {self.max_body_bytes} bytes.",
                code="request_too_large",
            )
            await error_response(error)(scope, receive, send_with_id)
        except asyncio.CancelledError:
            # Cancelled by the server at the end of a drain: say so, retryably, if we can.
            if not started:
                error = APIError(503, "The server is shutting down; retry the request.",
                                 type=SERVER_ERROR, code="overloaded")
                with contextlib.suppress(Exception):
                    await error_response(error)(scope, receive, send_with_id)
            raise
        except Exception:
            logger.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if started:
                raise
            await send_with_id({
                "type": "http.response.start",
                "status": 500,
                "headers": [(b"content-type", b"application/json")],
            })
            await send_with_id({"type": "http.response.body", "body": internal_error_body()})
        finally:
            self.metrics.observe_http(scope["path"], status)

    async def _limit_body(self, scope: Scope, headers: Headers, receive: Receive) -> Receive:
        """Refuse bodies over the limit; buffers only chunked bodies (no Content-Length)."""
        if scope["method"] not in _METHODS_WITH_BODY or scope["path"] in self.unlimited_paths:
            return receive
        length = headers.get("content-length")
        if length is not None:
            # A malformed length is the HTTP server's to refuse, not ours.
            if length.isdigit() and int(length) > self.max_body_bytes:
                raise _BodyTooLarge
            return receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return receive  # disconnected: the app will find out on its own receive
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return replay

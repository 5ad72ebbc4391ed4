"""The real app around a FakeEngine (engine/testing.py), and reading what it answers."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from app.core.config import Settings
from app.main import create_app
from engine.testing import FakeEngine, SubmittedRequest, fake_logprob, fake_top, render_chat

__all__ = [
    "FakeEngine",
    "SubmittedRequest",
    "asgi_client",
    "fake_logprob",
    "fake_top",
    "make_app",
    "parse_sse",
    "render_chat",
    "shared_data_dir",
]


def make_app(engine: FakeEngine | None = None, **settings: Any) -> tuple[FastAPI, FakeEngine]:
    """The real app around a FakeEngine; `settings` override Settings fields. Without a
    `data_dir`, apps share one temporary data directory (and SQLite database) per process,
    so that the migrations run once."""
    engine = engine if engine is not None else FakeEngine()
    settings.setdefault("data_dir", shared_data_dir())
    return create_app(engine, Settings(no_auth=True, **settings)), engine


@functools.cache
def shared_data_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="loraplex-test-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class _LifespanClient(httpx.AsyncClient):
    """An in-process client that also runs the app's lifespan (startup and shutdown), as
    a server would: ASGITransport alone does not."""

    def __init__(self, app: FastAPI) -> None:
        super().__init__(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
        self._lifespan = app.router.lifespan_context(app)

    async def __aenter__(self) -> _LifespanClient:
        await self._lifespan.__aenter__()
        await super().__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await super().__aexit__(*exc_info)
        await self._lifespan.__aexit__(*exc_info)


def asgi_client(app: FastAPI) -> httpx.AsyncClient:
    return _LifespanClient(app)


def parse_sse(body: str) -> list[Any]:
    """The events of an SSE body (JSON objects, then "[DONE]"), checking the framing."""
    assert body.endswith("\n\n"), body[-40:]
    events: list[Any] = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events

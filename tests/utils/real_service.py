"""The whole service on a real engine, served over real HTTP in a thread: a model on the
CPU, SQLite under a test directory, the test admin key; plus the usage rows it writes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, select

from app.core.config import Settings
from app.db import make_engine, session_factory
from app.main import create_app
from app.tables import UsageRecord
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from tests.utils.live_server import serve_in_thread
from tests.utils.saas import ADMIN_KEY, SECRET_KEY


@dataclass(slots=True)
class RealService:
    base_url: str
    engine: AsyncEngine
    database_url: str


@contextlib.contextmanager
def real_service(
    model_dir: Path, root: Path, *, loras: dict[str, Path] | None = None,
    engine_options: dict[str, Any] | None = None, **settings: Any,
) -> Iterator[RealService]:
    """`model_dir` served with keys (ADMIN_KEY) and SQLite under `root/data`; `loras` are
    preloaded as with `--lora`; `settings` override Settings fields."""
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu",
                                      **(engine_options or {})))
    engine.start_sync()
    database_url = f"sqlite:///{root / 'data' / 'db.sqlite'}"
    options = {"data_dir": root / "data", "database_url": database_url,
               "admin_key": ADMIN_KEY, "secret_key": SECRET_KEY, **settings}
    try:
        for name, path in (loras or {}).items():
            asyncio.run(engine.add_adapter(name, str(path)))
        with serve_in_thread(create_app(engine, Settings(**options))) as url:
            yield RealService(url, engine, database_url)
    finally:
        asyncio.run(engine.shutdown())


def usage_rows(
    database_url: str, where: ColumnElement[bool], *, at_least: int = 1, timeout_s: float = 20
) -> list[UsageRecord]:
    """The usage rows matching `where`, once the background writer has flushed at least
    `at_least` of them (or `timeout_s` passed: the caller asserts on what is there)."""
    db = make_engine(database_url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with session_factory(db)() as session:
                rows = list(session.scalars(select(UsageRecord).where(where)))
                for row in rows:
                    session.expunge(row)
            if len(rows) >= at_least or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)
    finally:
        db.dispose()

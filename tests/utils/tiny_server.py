"""Live servers (real HTTP) on a tiny random model, for tests that drive them with real
clients: one without keys with a preloaded PEFT adapter, and one with the admin key and
a registry to upload adapters into."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from app.core.config import Settings
from app.main import create_app
from app.server_options import preload_adapters
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from tests.utils.live_server import serve_in_thread


@dataclass
class Served:
    base_url: str
    model_dir: Path
    model_id: str
    adapter: Path  # served as ADAPTER_NAME


ADAPTER_NAME = "tuned"


@contextmanager
def serve_with_adapter(model_dir: Path, adapter: Path) -> Iterator[Served]:
    engine = AsyncEngine(EngineConfig(model=str(model_dir), max_loras=2, max_lora_rank=8))
    engine.start_sync()
    assert asyncio.run(preload_adapters(engine, {ADAPTER_NAME: adapter})) == []
    try:
        with serve_in_thread(create_app(engine, Settings(no_auth=True))) as url:
            yield Served(url, model_dir, engine.model_id, adapter)
    finally:
        asyncio.run(engine.shutdown())


@contextmanager
def serve_registry(model_dir: Path, root: Path, *, max_loras: int = 2
                   ) -> Iterator[tuple[str, AsyncEngine]]:
    """The app on SQLite under `root`, keys required (tests.utils.saas.ADMIN_KEY), its
    engine taking adapters of rank 8 at most; yields its URL and engine."""
    from tests.utils.saas import ADMIN_KEY, SECRET_KEY

    engine = AsyncEngine(EngineConfig(model=str(model_dir), max_loras=max_loras,
                                      max_lora_rank=8, device="cpu", dtype="float32"))
    engine.start_sync()
    app = create_app(engine, Settings(
        data_dir=root / "data", database_url=f"sqlite:///{root / 'db.sqlite'}",
        admin_key=ADMIN_KEY, secret_key=SECRET_KEY,
    ))
    try:
        with serve_in_thread(app) as url:
            yield url, engine
    finally:
        asyncio.run(engine.shutdown())

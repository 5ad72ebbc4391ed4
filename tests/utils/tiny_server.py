"""A live server (real HTTP, no keys) on a tiny random model with one preloaded PEFT
adapter, for tests that drive it with real clients."""

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

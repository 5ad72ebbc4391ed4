"""A replica that lists a version as ready before its engine has loaded it (just started
with many adapters, or a version uploaded on another replica): a request for it waits for
the load instead of a 404, and is refused with a retryable 503 or a 404 when the load
fails, runs too long, or the version goes away meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.api.openai import planning
from app.core.config import Settings
from app.main import create_app
from engine.client import AdapterInfo
from engine.errors import AdapterError
from tests.app.test_adapter_uploads import MiB, Server, running, zipped
from tests.app.test_registry import CheckingEngine, archive_bytes
from tests.utils.saas import ADMIN_KEY, SECRET_KEY


class GatedEngine(CheckingEngine):
    """Loads an adapter only once the test opens the gate (or refuses it then); with
    `held`, only the adapters named there wait for the gate."""

    def __init__(self, held: set[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loading = asyncio.Event()
        self.gate = asyncio.Event()
        self.refusal: str | None = None
        self.held = held

    async def add_adapter(self, name: str, path: str) -> AdapterInfo:
        if self.held is None or name in self.held:
            self.loading.set()
            await self.gate.wait()
        if self.refusal is not None:
            raise AdapterError(self.refusal)
        return await super().add_adapter(name, path)


@asynccontextmanager
async def second_replica(first: Server, engine: GatedEngine) -> AsyncIterator[httpx.AsyncClient]:
    """Another replica on the same database and adapter files, its own engine (and
    usage spool: one per process)."""
    data_dir = first.data_dir.with_name("second")
    data_dir.mkdir()
    (data_dir / "adapters").symlink_to(first.data_dir / "adapters")
    app = create_app(engine, Settings(
        data_dir=data_dir, database_url=first.database_url, admin_key=ADMIN_KEY,
        secret_key=SECRET_KEY, refresh_interval_s=0.1,
    ))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://testserver"
    ) as client:
        yield client


@pytest.fixture
async def first(database_url: str, tmp_path: Path) -> AsyncIterator[Server]:
    async with running(CheckingEngine(max_adapter_bytes=MiB), database_url,
                       tmp_path / "data") as server:
        yield server


async def _uploaded(first: Server, name: str = "bot") -> dict[str, Any]:
    r = await first.upload(zipped(archive_bytes()), name)
    assert r.status_code == 201, r.text
    return dict(r.json())


def _complete(client: httpx.AsyncClient, first: Server, model: str = "bot"
              ) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(client.post(
        "/v1/completions", headers=first.auth("a-reader"),
        json={"model": model, "prompt": "hi", "max_tokens": 1},
    ))


async def _still_waiting(task: asyncio.Task[httpx.Response]) -> None:
    await asyncio.sleep(0.3)
    assert not task.done(), task.result().text


@asynccontextmanager
async def request_waiting_for_a_load(
    first: Server,
) -> AsyncIterator[tuple[GatedEngine, httpx.AsyncClient, asyncio.Task[httpx.Response],
                         dict[str, Any]]]:
    """A version of "bot" uploaded on the first replica; a second replica whose engine
    holds its load at the gate; a request for it there, still waiting."""
    version = await _uploaded(first)
    engine = GatedEngine(max_adapter_bytes=MiB)
    async with second_replica(first, engine) as client:
        await asyncio.wait_for(engine.loading.wait(), 10)
        request = _complete(client, first)
        await _still_waiting(request)
        yield engine, client, request, version


async def _delete_and_see_it_gone(first: Server, second: httpx.AsyncClient,
                                  version: dict[str, Any]) -> None:
    """Delete the adapter on the first replica; wait until the second's directory has
    it no more."""
    deleted = await first.client.delete(f"/admin/adapters/{version['adapter_id']}",
                                        headers=first.auth("admin"))
    assert deleted.status_code == 200, deleted.text
    listed = ["bot"]
    for _ in range(100):
        models = await second.get("/v1/models", headers=first.auth("a-reader"))
        listed = [m["id"] for m in models.json()["data"]]
        if "bot" not in listed:
            break
        await asyncio.sleep(0.05)
    assert "bot" not in listed


async def test_a_request_waits_for_the_version_its_replica_is_loading(first: Server) -> None:
    async with request_waiting_for_a_load(first) as (engine, _client, request, version):
        engine.gate.set()
        done = await asyncio.wait_for(request, 10)
        assert done.status_code == 200, done.text
        assert engine.submitted[-1].adapter_id == f"av/{version['version_id']}"


async def test_a_request_loads_its_version_ahead_of_the_queue(first: Server) -> None:
    """A replica starting loads its versions one after another; a request for one far
    down the queue does not wait for those before it (here, one whose load hangs)."""
    slow = await _uploaded(first, "a-slow")  # first in the queue (by name)
    bot = await _uploaded(first, "bot")
    engine = GatedEngine(held={f"av/{slow['version_id']}"}, max_adapter_bytes=MiB)
    async with second_replica(first, engine) as client:
        await asyncio.wait_for(engine.loading.wait(), 10)  # the queue is stuck on a-slow
        done = await asyncio.wait_for(_complete(client, first, "bot"), 10)
        assert done.status_code == 200, done.text
        assert engine.get_adapter(f"av/{bot['version_id']}") is not None
        assert engine.get_adapter(f"av/{slow['version_id']}") is None
        waiting = _complete(client, first, "a-slow")  # joins the load under way
        await _still_waiting(waiting)
        engine.gate.set()
        served = await asyncio.wait_for(waiting, 10)
        assert served.status_code == 200, served.text
        assert [c[0] for c in engine.add_calls].count(f"av/{slow['version_id']}") == 1


async def test_a_version_deleted_after_its_load_began_is_not_left_loaded(
    first: Server,
) -> None:
    async with request_waiting_for_a_load(first) as (engine, client, request, version):
        await _delete_and_see_it_gone(first, client, version)
        engine.gate.set()  # the load succeeds, for a version no longer ready
        gone = await asyncio.wait_for(request, 10)
        assert gone.status_code == 404, gone.text
        for _ in range(100):
            if not engine.list_adapters():
                break
            await asyncio.sleep(0.05)
        assert engine.list_adapters() == []


async def test_a_load_that_fails_is_a_retryable_503_naming_why(first: Server) -> None:
    async with request_waiting_for_a_load(first) as (engine, _client, request, _):
        engine.refusal = "the disk under the adapter store is gone"
        engine.gate.set()
        refused = await asyncio.wait_for(request, 10)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "adapter_unavailable"
        assert "the disk under the adapter store is gone" in refused.json()["error"]["message"]
        assert "retry-after" in refused.headers
        assert engine.submitted == []


async def test_a_load_that_runs_past_the_wait_is_a_retryable_503(
    first: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _uploaded(first)
    monkeypatch.setattr(planning, "ADAPTER_LOAD_WAIT_S", 0.5)
    engine = GatedEngine(max_adapter_bytes=MiB)
    async with second_replica(first, engine) as client:
        await asyncio.wait_for(engine.loading.wait(), 10)
        refused = await asyncio.wait_for(_complete(client, first), 10)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "adapter_unavailable"
        assert "not loaded on this replica yet" in error["message"]
        engine.gate.set()  # the load completes: the next try is served
        for _ in range(100):
            if engine.list_adapters():
                break
            await asyncio.sleep(0.05)
        served = await _complete(client, first)
        assert served.status_code == 200, served.text


async def test_a_version_deleted_while_it_loads_is_a_404(first: Server) -> None:
    async with request_waiting_for_a_load(first) as (engine, client, request, version):
        await _delete_and_see_it_gone(first, client, version)
        engine.refusal = "its files were removed"
        engine.gate.set()
        gone = await asyncio.wait_for(request, 10)
        assert gone.status_code == 404, gone.text
        assert gone.json()["error"]["code"] == "model_not_found"

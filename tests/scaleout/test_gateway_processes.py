"""A `loraplex gateway` process on real Redis and SQLite, with workers that join it later
(the worker app around a FakeEngine, in this process, over Redis heartbeats) or that
are `loraplex worker` processes with adapters of their own (`--lora`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from sqlalchemy import func, select

from app.db import make_engine, session_factory, session_scope
from app.tables import Adapter, AdapterVersion
from engine.client import WORKER_HEADER
from engine.remote.heartbeat import HeartbeatPublisher, make_identity
from engine.remote.worker_app import create_worker_app
from tests.app.test_registry import CheckingEngine
from tests.utils.live_server import serve_in_thread
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.processes import cli_process, free_port, log_tail, scaleout_env, wait_until
from tests.utils.saas import ADMIN_KEY, bearer, upload_adapter

pytestmark = pytest.mark.usefixtures("event_loop_watchdog")

TOKEN = "gateway-test-token-0123456789abcdef"


def _env(tmp_path: Path, redis_url: str, sqlite_url: str) -> dict[str, str]:
    return scaleout_env(tmp_path / "data", redis_url, sqlite_url, TOKEN,
                        LORAPLEX_REFRESH_INTERVAL_S="0.1")


@contextlib.contextmanager
def _gateway(model_dir: Path, env: dict[str, str], log: Path, *extra: str
             ) -> Iterator[httpx.Client]:
    port = free_port()
    with ExitStack() as stack:
        stack.enter_context(cli_process(["gateway", "--port", str(port), "--model", str(model_dir),
                                      *extra], env, log))
        client = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                                  timeout=30))
        wait_until(lambda: client.get("/health").status_code == 200, 60, "the gateway up", [log])
        yield client


def _ask(client: httpx.Client, model: str) -> httpx.Response:
    """A greedy chat completion without a key (the gateway runs with --no-auth)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say something"}],
            "max_tokens": 8, "temperature": 0}
    return client.post("/v1/chat/completions", json=body)


def _rows(database_url: str) -> tuple[int, int]:
    engine = make_engine(database_url)
    try:
        with session_scope(session_factory(engine)) as s:
            adapters = s.scalar(select(func.count()).select_from(Adapter)) or 0
            versions = s.scalar(select(func.count()).select_from(AdapterVersion)) or 0
            return int(adapters), int(versions)
    finally:
        engine.dispose()


def _entries(directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


async def test_an_upload_before_any_worker_is_refused_with_503_and_leaves_nothing(
    tiny_model_factory: Callable[[str], Path], redis_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    adapter_dir = make_peft_adapter(model_dir, tmp_path / "adapter", r=4, alpha=8, seed=5)
    env = _env(tmp_path, redis_url, sqlite_url)
    data_dir = tmp_path / "data"
    log = tmp_path / "gateway.log"
    with _gateway(model_dir, env, log) as client:
        # The admin API answers before any worker is in rotation.
        assert client.get("/ready").status_code == 503
        refused = await asyncio.to_thread(upload_adapter, client, ADMIN_KEY, "early",
                                          adapter_dir, path="/admin/adapters")
        assert refused.status_code == 503, refused.text + log_tail(log)
        assert refused.headers["retry-after"] == "2"
        error = refused.json()["error"]
        assert (error["code"], error["type"]) == ("overloaded", "server_error")
        assert "no engine worker" in error["message"].lower()
        # Nothing half-made: no rows, no stored files, no upload left in tmp/.
        assert _rows(sqlite_url) == (0, 0)
        assert _entries(data_dir / "adapters") == []
        assert _entries(data_dir / "tmp") == []
        listed = client.get("/admin/adapters", headers=bearer(ADMIN_KEY))
        assert listed.json()["data"] == []

        # A worker joins; the same upload, retried, is version 1 and ready.
        engine = CheckingEngine(model_id=model_dir.name, max_model_len=2048)
        app = create_worker_app(engine, token=TOKEN, data_dir=data_dir, keepalive_s=0.1)
        with serve_in_thread(app) as url:
            identity = make_identity(worker_id="late", url=url, device="cpu", mig_profile=None,
                                     dedicated_tenants=())
            publisher = HeartbeatPublisher(aioredis.Redis.from_url(redis_url), identity, engine,
                                           interval_s=0.2, ttl_s=1.0)
            await publisher.start()
            try:
                deadline = time.monotonic() + 15
                while (await asyncio.to_thread(client.get, "/ready")).status_code != 200:
                    assert time.monotonic() < deadline, log_tail(log)
                    await asyncio.sleep(0.1)
                retried = await asyncio.to_thread(upload_adapter, client, ADMIN_KEY, "early",
                                                  adapter_dir, path="/admin/adapters")
                assert retried.status_code == 201, retried.text + log_tail(log)
                body = retried.json()
                assert (body["name"], body["version"], body["status"]) == ("early", 1, "ready")
                assert [n for n, _ in engine.add_calls] == [f"av/{body['version_id']}"]
                assert _rows(sqlite_url) == (1, 1)
                assert _entries(data_dir / "adapters") == [body["sha256"]]
            finally:
                await publisher.stop()
                await publisher.redis.aclose()


def test_a_worker_serves_its_own_lora_behind_a_gateway_without_auth(
    tiny_model_factory: Callable[[str], Path], redis_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    adapter_dir = make_peft_adapter(model_dir, tmp_path / "adapter", r=4, alpha=8, seed=3)
    env = _env(tmp_path, redis_url, sqlite_url)
    engine_flags = ["--model", str(model_dir), "--device", "cpu", "--kv-cache-tokens", "2048",
                    "--max-num-seqs", "4", "--max-loras", "2", "--max-lora-rank", "8"]
    logs = {name: tmp_path / f"{name}.log" for name in ("w1", "w2", "gateway")}
    with ExitStack() as stack:
        # Only w1 has the adapter: every request for it must go there.
        for name, loras in (("w1", ["--lora", f"house={adapter_dir}"]), ("w2", [])):
            stack.enter_context(cli_process(
                ["worker", "--port", str(free_port()), "--worker-id", name, *engine_flags,
                 *loras], env, logs[name],
            ))
        client = stack.enter_context(_gateway(model_dir, env, logs["gateway"], "--no-auth"))
        all_logs = list(logs.values())

        def in_rotation() -> list[str]:
            view = client.get("/admin/engine")
            if view.status_code != 200:
                return []
            return [w["id"] for w in view.json()["workers"] if w["in_rotation"]]

        wait_until(lambda: in_rotation() == ["w1", "w2"], 120, "two workers in rotation",
                  all_logs)
        models = client.get("/v1/models")
        assert models.status_code == 200, models.text
        assert [m["id"] for m in models.json()["data"]] == [model_dir.name, "house"]
        answers = [_ask(client, "house") for _ in range(4)]
        assert [r.status_code for r in answers] == [200] * 4, answers[0].text
        assert {r.headers[WORKER_HEADER] for r in answers} == {"w1"}
        with_adapter = answers[0].json()["choices"][0]["message"]["content"]
        base = _ask(client, model_dir.name)
        assert base.status_code == 200, base.text
        assert base.json()["choices"][0]["message"]["content"] != with_adapter
        unknown = _ask(client, "nobody")
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"

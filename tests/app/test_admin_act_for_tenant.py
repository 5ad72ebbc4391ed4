"""An admin acting for a tenant (`X-Loraplex-Tenant`) on the generation routes and
/v1/models, over real HTTP with the real `openai` client, on SQLite and PostgreSQL: the
tenant's own and the shared adapters resolve, nobody else's do; tenant keys may not send
the header; the calls are the admin's own (no tenant quota, no tenant usage row)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select

from app.core.config import Settings
from app.db import make_engine, session_factory, session_scope
from app.main import create_app
from app.tables import UsageRecord
from tests.utils.fake_engine import FakeEngine
from tests.utils.live_server import serve_in_thread
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer, create_key, create_tenant, tar_gz

MODEL = "fake-model"
HEADER = "X-Loraplex-Tenant"
USER = [{"role": "user", "content": "hi"}]


@dataclass
class Env:
    base_url: str
    engine: FakeEngine
    database_url: str
    tenants: dict[str, str]  # "a" / "b" -> tenant id
    keys: dict[str, str]  # "a", "b", "admin" (a database admin key) -> key
    admin_key_id: str
    versions: dict[str, str]  # adapter name -> its version id

    def openai(self, who: str, tenant: str | None = None) -> openai.OpenAI:
        headers = {} if tenant is None else {HEADER: tenant}
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.keys[who], max_retries=0,
            default_headers=headers,
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30)

    def usage_row(self, request_id: str) -> UsageRecord:
        """The request's usage row, once the background writer has flushed it."""
        engine = make_engine(self.database_url)
        try:
            deadline = time.monotonic() + 20
            while True:
                with session_scope(session_factory(engine)) as s:
                    row = s.scalar(
                        select(UsageRecord).where(UsageRecord.request_id == request_id)
                    )
                    if row is not None:
                        s.expunge(row)
                        return row
                assert time.monotonic() < deadline, f"no usage row for {request_id}"
                time.sleep(0.05)
        finally:
            engine.dispose()


def _adapter_dir(root: Path, name: str) -> Path:
    """A PEFT-shaped directory, distinct per name (the fake engine does not read it)."""
    path = root / name
    path.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "adapter_model.safetensors").write_bytes(f"weights of {name}".encode())
    return path


def _upload(client: httpx.Client, root: Path, name: str, tenant_id: str | None) -> str:
    data = {"name": name} if tenant_id is None else {"name": name, "tenant_id": tenant_id}
    response = client.post(
        "/admin/adapters",
        files={"file": ("a.tar.gz", tar_gz(_adapter_dir(root, name)), "application/gzip")},
        data=data, headers=bearer(ADMIN_KEY),
    )
    assert response.status_code == 201, response.text
    return str(response.json()["version_id"])


@pytest.fixture
def env(database_url: str, tmp_path: Path) -> Iterator[Env]:
    engine = FakeEngine(model_id=MODEL, max_model_len=4096)
    settings = Settings(
        data_dir=tmp_path / "data", database_url=database_url, admin_key=ADMIN_KEY,
        secret_key=SECRET_KEY,
    )
    with serve_in_thread(create_app(engine, settings)) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        # rpm=1: a second request of the tenant's own in this minute is refused.
        a = create_tenant(client, "tenant-a", rpm=1)
        b = create_tenant(client, "tenant-b")
        admin = client.post("/admin/keys", json={"name": "ops"}, headers=bearer(ADMIN_KEY))
        assert admin.status_code == 201, admin.text
        keys = {
            "a": create_key(client, a["id"])["key"],
            "b": create_key(client, b["id"])["key"],
            "admin": admin.json()["key"],
        }
        versions = {
            "a-bot": _upload(client, tmp_path / "src", "a-bot", a["id"]),
            "b-bot": _upload(client, tmp_path / "src", "b-bot", b["id"]),
            "common": _upload(client, tmp_path / "src", "common", None),
        }
        yield Env(url, engine, database_url, {"a": a["id"], "b": b["id"]}, keys,
                  admin.json()["id"], versions)


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"}
    return dict(body["error"])


def test_admin_sees_and_uses_the_tenants_adapters(env: Env) -> None:
    acting = env.openai("admin", tenant=env.tenants["a"])
    assert {m.id for m in acting.models.list().data} == {MODEL, "a-bot", "common"}
    assert {m.id for m in env.openai("admin").models.list().data} == {MODEL, "common"}

    chat = acting.chat.completions.create(model="a-bot", messages=USER, max_tokens=3)  # type: ignore[arg-type]
    assert chat.model == "a-bot" and chat.choices[0].message.content
    completion = acting.completions.create(model="a-bot@1", prompt="hello", max_tokens=2)
    assert completion.choices[0].text == "he"
    acting.completions.create(model="common", prompt="hello", max_tokens=2)
    ran = [r.adapter_id for r in env.engine.submitted]
    assert ran == [f"av/{env.versions[n]}" for n in ("a-bot", "a-bot", "common")]

    # Another tenant's adapter stays invisible, acting or not.
    for client in (acting, env.openai("admin")):
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model="b-bot", messages=USER, max_tokens=1)  # type: ignore[arg-type]
        assert _error(caught.value)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        env.openai("admin").completions.create(model="a-bot", prompt="x", max_tokens=1)
    assert len(env.engine.submitted) == 3


def test_unknown_tenant_is_404_on_every_route(env: Env) -> None:
    with env.http() as client:
        headers = {**bearer(env.keys["admin"]), HEADER: "t_doesnotexist"}
        answers = [
            client.get("/v1/models", headers=headers),
            client.post("/v1/chat/completions", headers=headers,
                        json={"model": MODEL, "messages": USER, "max_tokens": 1}),
            client.post("/v1/completions", headers=headers,
                        json={"model": MODEL, "prompt": "x", "max_tokens": 1}),
            # An empty header names no tenant either.
            client.get("/v1/models", headers={**bearer(env.keys["admin"]), HEADER: ""}),
        ]
    for response in answers:
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["code"] == "tenant_not_found"
        assert HEADER in error["message"]
    assert "'t_doesnotexist'" in answers[0].json()["error"]["message"]
    assert env.engine.submitted == []


def test_tenant_keys_may_not_send_the_header(env: Env) -> None:
    for tenant in (env.tenants["b"], env.tenants["a"], "t_doesnotexist"):
        client = env.openai("a", tenant=tenant)
        with pytest.raises(openai.PermissionDeniedError) as caught:
            client.chat.completions.create(model="b-bot", messages=USER, max_tokens=1)  # type: ignore[arg-type]
        error = _error(caught.value)
        assert error["code"] == "permission_denied" and HEADER in error["message"]
        with pytest.raises(openai.PermissionDeniedError):
            client.models.list()
    assert env.engine.submitted == []
    # Without the header the tenant's key works as before: its own adapter, not B's.
    assert {m.id for m in env.openai("a").models.list().data} == {MODEL, "a-bot", "common"}


def test_acting_calls_are_the_admins_own(env: Env) -> None:
    acting = env.openai("admin", tenant=env.tenants["a"])
    ids = [
        acting.chat.completions.create(model="a-bot", messages=USER, max_tokens=2).id  # type: ignore[arg-type]
        for _ in range(3)
    ]
    # Three calls for tenant A, whose rpm is 1: none of them counted against it.
    own = env.openai("a").chat.completions.create(model="a-bot", messages=USER, max_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError):
        env.openai("a").chat.completions.create(model="a-bot", messages=USER, max_tokens=2)  # type: ignore[arg-type]

    for request_id in ids:
        row = env.usage_row(request_id)
        assert (row.tenant_id, row.key_id, row.model) == (None, env.admin_key_id, "a-bot")
        assert row.completion_tokens == 2
    assert env.usage_row(own.id).tenant_id == env.tenants["a"]
    # The tenant's own usage report holds its one call, none of the admin's.
    with env.http() as client:
        report = client.get("/v1/usage", headers=bearer(env.keys["a"]))
        assert report.status_code == 200, report.text
        assert report.json()["totals"]["requests"] == 1
        # The fake engine saw no tenant on the admin's calls (no fairness share of A's).
        assert [r.tenant is None for r in env.engine.submitted] == [True] * 3 + [False]

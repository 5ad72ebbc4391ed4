"""Admin routes for tenants, keys and the audit log, over real HTTP (ASGI) on SQLite
and PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session, sessionmaker

from app.api.errors import install_exception_handlers, service_error
from app.api.middleware import RequestContextMiddleware
from app.api.routes.admin_tenants import router
from app.api.state import AppState
from app.billing.service import PlanCreate, create_plan
from app.core.config import Settings
from app.core.errors import ServiceError
from app.core.security import hash_key, well_formed
from app.db import make_engine, session_factory, session_scope
from app.directory import Directory
from app.metrics import Metrics
from app.tables import Adapter, ApiKey, AuditLog, Tenant, UsageRecord, new_id, utcnow
from tests.utils.fake_engine import FakeEngine

SECRET = "admin-routes-test-secret-0123456789abcdef"
ADMIN_KEY = "bootstrap-admin-key-for-tests-0123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass(slots=True)
class Api:
    client: httpx.AsyncClient
    directory: Directory
    db: sessionmaker[Session]
    database_url: str


@pytest.fixture
def db_engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
async def api(
    database_url: str, db_engine: Engine, tmp_path: Path
) -> AsyncIterator[Api]:
    db = session_factory(db_engine)
    directory = Directory(db, secret=SECRET, admin_key=ADMIN_KEY, refresh_interval_s=0.5)
    directory.load()
    engine = FakeEngine()
    settings = Settings(data_dir=tmp_path, admin_key=ADMIN_KEY, secret_key=SECRET)
    metrics = Metrics(engine)
    app = FastAPI()
    install_exception_handlers(app)
    app.add_middleware(RequestContextMiddleware, max_body_bytes=1 << 20, metrics=metrics)
    app.include_router(router)
    app.state.loraplex = AppState(
        engine=engine, settings=settings, metrics=metrics, db=db, directory=directory,
        limiter=None, usage=None, registry=None, evals=None,  # type: ignore[arg-type]
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield Api(client=client, directory=directory, db=db, database_url=database_url)


def error(message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def new_tenant(api: Api, name: str = "acme", **fields: Any) -> dict[str, Any]:
    response = await api.client.post("/admin/tenants", json={"name": name, **fields}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return dict(response.json())


def new_plan(api: Api, name: str) -> None:
    """A tenant's `plan` must name an existing price plan."""
    body = PlanCreate(name=name, currency="USD", prompt_per_mtok="1",
                      completion_per_mtok="2", cached_prompt_per_mtok="0.5")
    with session_scope(api.db) as session:
        create_plan(session, body, actor="test", request_id=None)


async def new_key(api: Api, tenant_id: str, **fields: Any) -> dict[str, Any]:
    response = await api.client.post(
        f"/admin/tenants/{tenant_id}/keys", json={"name": "ci", **fields}, headers=ADMIN
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def principal_of(api: Api, key: str) -> Any:
    return api.directory.authenticate(f"Bearer {key}")


def refused(api: Api, key: str) -> str:
    with pytest.raises(ServiceError) as caught:
        api.directory.authenticate(f"Bearer {key}")
    assert service_error(caught.value).status_code == 401
    return caught.value.message


# ---------------------------------------------------------------------------- tenants


async def test_create_get_list_tenant(api: Api) -> None:
    new_plan(api, "pro")
    body = {
        "name": "acme",
        "tier": "premium",
        "isolation": "dedicated",
        "quotas": {"rpm": 60, "tpm": 10_000, "max_adapters": 3},
        "plan": "pro",
    }
    response = await api.client.post("/admin/tenants", json=body, headers=ADMIN)
    assert response.status_code == 201
    tenant = response.json()
    assert tenant["id"].startswith("ten_")
    assert isinstance(tenant["created_at"], int) and tenant["updated_at"] >= tenant["created_at"]
    assert {k: v for k, v in tenant.items() if k not in ("id", "created_at", "updated_at")} == {
        "object": "tenant",
        "name": "acme",
        "tier": "premium",
        "isolation": "dedicated",
        "plan": "pro",
        "quotas": {
            "rpm": 60, "tpm": 10_000, "max_concurrency": None, "monthly_tokens": None,
            "max_tokens": None, "max_context_tokens": None, "max_adapters": 3,
        },
        "disabled": False,
        "deleted_at": None,
    }
    got = await api.client.get(f"/admin/tenants/{tenant['id']}", headers=ADMIN)
    assert got.json() == tenant
    listed = await api.client.get("/admin/tenants", headers=ADMIN)
    assert listed.json() == {"object": "list", "data": [tenant]}
    # The route refreshed this replica's directory: the tenant is known at once.
    info = api.directory.tenant(tenant["id"])
    assert info is not None and (info.name, info.quotas.rpm) == ("acme", 60)

    minimal = await new_tenant(api, "small")
    assert (minimal["tier"], minimal["isolation"], minimal["plan"]) == ("standard", "shared", None)
    assert set(minimal["quotas"].values()) == {None}


async def test_patch_merges_quotas_and_null_means_unlimited(api: Api) -> None:
    new_plan(api, "basic")
    tenant = await new_tenant(api, quotas={"rpm": 10, "tpm": 100}, plan="basic")
    path = f"/admin/tenants/{tenant['id']}"
    patched = (await api.client.patch(path, json={"quotas": {"rpm": 20}}, headers=ADMIN)).json()
    assert (patched["quotas"]["rpm"], patched["quotas"]["tpm"]) == (20, 100)
    body = {"quotas": {"tpm": None}, "tier": "batch"}
    patched = (await api.client.patch(path, json=body, headers=ADMIN)).json()
    quotas = patched["quotas"]
    assert (quotas["rpm"], quotas["tpm"], patched["tier"]) == (20, None, "batch")
    patched = (await api.client.patch(path, json={"plan": None}, headers=ADMIN)).json()
    assert patched["plan"] is None
    assert patched["name"] == "acme"
    info = api.directory.tenant(tenant["id"])
    assert info is not None and (info.quotas.rpm, info.quotas.tpm, info.plan) == (20, None, None)

    response = await api.client.patch(path, json={"name": None}, headers=ADMIN)
    assert response.status_code == 400
    assert response.json() == error("'name' cannot be null; omit it to keep it.", param="name")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"name": "x", "id": "ten_mine"},
            "id",
            "Invalid value for 'id': Extra inputs are not permitted.",
        ),
        ({"name": "x", "deleted_at": None}, "deleted_at", None),
        ({"name": "x", "quotas": {"rpm": 5, "burst": 9}}, "quotas.burst", None),
        ({"name": "x", "quotas": {"rpm": 0}}, "quotas.rpm", None),
        ({"name": "x", "quotas": {"rpm": "10"}}, "quotas.rpm", None),
        ({"name": "x", "quotas": {"max_tokens": 2**31}}, "quotas.max_tokens", None),
        ({"name": "x", "tier": "gold"}, "tier", None),
        ({"name": " padded"}, "name", None),
        ({"tier": "batch"}, "name", "Missing required parameter: 'name'."),
    ],
)
async def test_tenant_bodies_refuse_unknown_and_bad_fields(
    api: Api, body: dict[str, Any], param: str, message: str | None
) -> None:
    response = await api.client.post("/admin/tenants", json=body, headers=ADMIN)
    assert response.status_code == 400, response.text
    got = response.json()["error"]
    assert (got["param"], got["type"]) == (param, "invalid_request_error")
    if message is not None:
        assert got["message"] == message
    listed = await api.client.get("/admin/tenants", headers=ADMIN)
    assert listed.json()["data"] == []


async def test_duplicate_names_conflict(api: Api) -> None:
    first = await new_tenant(api, "acme")
    other = await new_tenant(api, "globex")
    again = await api.client.post("/admin/tenants", json={"name": "acme"}, headers=ADMIN)
    assert again.status_code == 409
    assert again.json() == error(
        "A tenant named 'acme' already exists (or existed).", param="name", code="conflict"
    )
    renamed = await api.client.patch(
        f"/admin/tenants/{other['id']}", json={"name": "acme"}, headers=ADMIN
    )
    assert renamed.status_code == 409
    # Renaming to its own name is no change at all.
    same = await api.client.patch(
        f"/admin/tenants/{first['id']}", json={"name": "acme"}, headers=ADMIN
    )
    assert same.status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/admin/tenants/ten_nope", None),
        ("PATCH", "/admin/tenants/ten_nope", {"tier": "batch"}),
        ("DELETE", "/admin/tenants/ten_nope", None),
        ("GET", "/admin/tenants/ten_nope/keys", None),
        ("POST", "/admin/tenants/ten_nope/keys", {"name": "k"}),
    ],
)
async def test_unknown_tenant_is_404(
    api: Api, method: str, path: str, body: dict[str, Any] | None
) -> None:
    response = await api.client.request(method, path, json=body, headers=ADMIN)
    assert response.status_code == 404
    assert response.json() == error("No tenant with id 'ten_nope'.", code="not_found")


async def test_unknown_key_is_404(api: Api) -> None:
    response = await api.client.delete("/admin/keys/key_nope", headers=ADMIN)
    assert response.status_code == 404
    assert response.json() == error("No API key with id 'key_nope'.", code="not_found")


# ------------------------------------------------------------------------------- keys


def every_stored_value(db: sessionmaker[Session]) -> list[str]:
    with db() as session:
        values: list[str] = []
        for table in ("tenants", "api_keys", "audit_log", "adapters"):
            for row in session.execute(text(f"SELECT * FROM {table}")):
                values.extend(str(v) for v in row)
    return values


async def test_key_lifecycle(api: Api) -> None:
    tenant = await new_tenant(api)
    created = await new_key(api, tenant["id"], name="ci runner")
    key = created.pop("key")
    assert well_formed(key) and key.startswith("lpx_t_")
    assert created["id"].startswith("key_")
    assert {k: v for k, v in created.items() if k not in ("id", "created_at")} == {
        "object": "api_key", "name": "ci runner", "prefix": key[:12], "tenant_id": tenant["id"],
        "is_admin": False, "scopes": ["inference"], "created_by": "bootstrap",
        "expires_at": None, "revoked_at": None,
    }
    principal = principal_of(api, key)
    assert (principal.actor, principal.key_id, principal.tenant_id, principal.scopes) == (
        created["id"], created["id"], tenant["id"], frozenset({"inference"})
    )

    listed = await api.client.get(f"/admin/tenants/{tenant['id']}/keys", headers=ADMIN)
    assert listed.json() == {"object": "list", "data": [created]}
    assert key[12:] not in listed.text

    # Only the keyed hash and the display prefix are stored; the key is nowhere.
    stored = every_stored_value(api.db)
    assert not [v for v in stored if key in v or key[12:] in v]
    with api.db() as session:
        row = session.get(ApiKey, created["id"])
        assert row is not None and row.key_hash == hash_key(key, SECRET)

    revoke = await api.client.delete(f"/admin/keys/{created['id']}", headers=ADMIN)
    assert revoke.status_code == 204 and revoke.content == b""
    assert refused(api, key).endswith("was revoked.")
    # The same revocation, seen by another replica on its next refresh.
    other_engine = make_engine(api.database_url)
    try:
        replica = Directory(
            session_factory(other_engine), secret=SECRET, admin_key=None, refresh_interval_s=1
        )
        replica.load()
        with pytest.raises(ServiceError, match="was revoked"):
            replica.authenticate(f"Bearer {key}")
    finally:
        other_engine.dispose()
    again = await api.client.delete(f"/admin/keys/{created['id']}", headers=ADMIN)
    assert again.status_code == 204
    listed = await api.client.get(f"/admin/tenants/{tenant['id']}/keys", headers=ADMIN)
    assert isinstance(listed.json()["data"][0]["revoked_at"], int)
    audit = await api.client.get(f"/admin/audit?target_id={created['id']}", headers=ADMIN)
    assert [e["action"] for e in audit.json()["data"]] == ["key.revoke", "key.create"]


async def test_key_scopes_and_expiry(api: Api) -> None:
    tenant = await new_tenant(api)
    later = (utcnow() + timedelta(hours=1)).replace(microsecond=0)
    created = await new_key(
        api, tenant["id"], scopes=["adapters:write", "inference", "inference"],
        expires_at=later.isoformat(),
    )
    assert created["scopes"] == ["adapters:write", "inference"]
    assert created["expires_at"] == int(later.timestamp())
    assert principal_of(api, created["key"]).scopes == frozenset({"inference", "adapters:write"})

    path = f"/admin/tenants/{tenant['id']}/keys"
    past = (utcnow() - timedelta(seconds=5)).isoformat()
    response = await api.client.post(path, json={"name": "k", "expires_at": past}, headers=ADMIN)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "expires_at"
    assert response.json()["error"]["message"].startswith("'expires_at' must be in the future")
    naive = await api.client.post(
        path, json={"name": "k", "expires_at": "2999-01-01T00:00:00"}, headers=ADMIN
    )
    assert (naive.status_code, naive.json()["error"]["param"]) == (400, "expires_at")
    for scopes, param in (([], "scopes"), (["admin"], "scopes[0]")):
        response = await api.client.post(path, json={"name": "k", "scopes": scopes}, headers=ADMIN)
        assert (response.status_code, response.json()["error"]["param"]) == (400, param)
    for field in ("tenant_id", "is_admin", "key_hash", "id", "prefix"):
        response = await api.client.post(path, json={"name": "k", field: "x"}, headers=ADMIN)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == field
    listed = await api.client.get(path, headers=ADMIN)
    assert len(listed.json()["data"]) == 1


async def test_disabled_tenant_keys_stop_working(api: Api) -> None:
    tenant = await new_tenant(api)
    key = (await new_key(api, tenant["id"]))["key"]
    path = f"/admin/tenants/{tenant['id']}"
    assert (await api.client.patch(path, json={"disabled": True}, headers=ADMIN)).json()["disabled"]
    assert refused(api, key) == "The account of this API key is disabled."
    await api.client.patch(path, json={"disabled": False}, headers=ADMIN)
    assert principal_of(api, key).tenant_id == tenant["id"]


async def test_admin_keys(api: Api) -> None:
    tenant = await new_tenant(api)
    await new_key(api, tenant["id"])
    response = await api.client.post("/admin/keys", json={"name": "ops"}, headers=ADMIN)
    assert response.status_code == 201
    created = response.json()
    key = created.pop("key")
    assert key.startswith("lpx_a_") and created["is_admin"] and created["tenant_id"] is None
    assert created["scopes"] == ["inference", "adapters:write"]
    listed = await api.client.get("/admin/keys", headers=ADMIN)
    assert listed.json() == {"object": "list", "data": [created]}  # tenant keys not listed

    # The new admin key acts under its own id in the audit log.
    made = await api.client.post("/admin/tenants", json={"name": "by-ops"}, headers=bearer(key))
    assert made.status_code == 201
    audit = await api.client.get(f"/admin/audit?target_id={made.json()['id']}", headers=bearer(key))
    assert [(e["action"], e["actor"]) for e in audit.json()["data"]] == [
        ("tenant.create", created["id"])
    ]
    bad = await api.client.post("/admin/keys", json={"name": "x", "is_admin": False}, headers=ADMIN)
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "is_admin")

    revoked = await api.client.delete(f"/admin/keys/{created['id']}", headers=ADMIN)
    assert revoked.status_code == 204
    after = await api.client.get("/admin/tenants", headers=bearer(key))
    assert after.status_code == 401
    assert after.json()["error"]["code"] == "invalid_api_key"


# ------------------------------------------------------------------------------ access


ROUTES = [
    ("POST", "/admin/tenants", {"name": "mine", "id": "ten_x"}),
    ("GET", "/admin/tenants", None),
    ("GET", "/admin/tenants/{tenant}", None),
    ("PATCH", "/admin/tenants/{tenant}", {"quotas": {"rpm": None}}),
    ("DELETE", "/admin/tenants/{tenant}", None),
    ("POST", "/admin/tenants/{tenant}/keys", {"name": "k", "scopes": ["adapters:write"]}),
    ("GET", "/admin/tenants/{tenant}/keys", None),
    ("POST", "/admin/keys", {"name": "root"}),
    ("GET", "/admin/keys", None),
    ("DELETE", "/admin/keys/{key}", None),
    ("GET", "/admin/audit", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
async def test_tenant_keys_get_403_and_no_key_401(
    api: Api, method: str, path: str, body: dict[str, Any] | None
) -> None:
    tenant = await new_tenant(api)
    created = await new_key(api, tenant["id"], scopes=["inference", "adapters:write"])
    url = path.format(tenant=tenant["id"], key=created["id"])
    response = await api.client.request(method, url, json=body, headers=bearer(created["key"]))
    assert response.status_code == 403
    assert response.json() == error(
        "This route needs an admin key; tenant keys cannot use it.", code="permission_denied"
    )
    anonymous = await api.client.request(method, url, json=body)
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"] == "Bearer"
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    # Nothing changed: the tenant and its key are as they were.
    assert principal_of(api, created["key"]).tenant_id == tenant["id"]
    with api.db() as session:
        assert session.scalars(select(Tenant.name)).all() == ["acme"]
        assert len(session.scalars(select(ApiKey)).all()) == 1


# ------------------------------------------------------------------------------ delete


async def test_delete_tenant_revokes_keys_and_deletes_adapters(api: Api) -> None:
    tenant = await new_tenant(api)
    keys = [(await new_key(api, tenant["id"]))["key"] for _ in range(2)]
    with session_scope(api.db) as session:
        session.add(Adapter(id=new_id("ad"), tenant_id=tenant["id"], owner=tenant["id"], name="a"))
        session.add(UsageRecord(
            request_id="req-usage-1", tenant_id=tenant["id"], model="a", status="ok",
            prompt_tokens=3, completion_tokens=4, created_at=utcnow(),
        ))
    response = await api.client.delete(f"/admin/tenants/{tenant['id']}", headers=ADMIN)
    assert response.status_code == 204
    for key in keys:
        assert refused(api, key).endswith("was revoked.")
    assert api.directory.tenant(tenant["id"]) is None
    with api.db() as session:
        assert [r.deleted_at is not None for r in session.scalars(select(Adapter))] == [True]
        assert len(session.scalars(select(UsageRecord)).all()) == 1  # kept for billing
    listed = await api.client.get(f"/admin/tenants/{tenant['id']}/keys", headers=ADMIN)
    assert all(k["revoked_at"] is not None for k in listed.json()["data"])
    got = (await api.client.get(f"/admin/tenants/{tenant['id']}", headers=ADMIN)).json()
    assert got["disabled"] and isinstance(got["deleted_at"], int)
    assert (await api.client.get("/admin/tenants", headers=ADMIN)).json()["data"] == []
    everything = await api.client.get("/admin/tenants?include_deleted=true", headers=ADMIN)
    assert [t["id"] for t in everything.json()["data"]] == [tenant["id"]]
    for method, path, body in (
        ("DELETE", f"/admin/tenants/{tenant['id']}", None),
        ("PATCH", f"/admin/tenants/{tenant['id']}", {"disabled": False}),
        ("POST", f"/admin/tenants/{tenant['id']}/keys", {"name": "k"}),
    ):
        again = await api.client.request(method, path, json=body, headers=ADMIN)
        assert again.status_code == 404, (method, path)
    # The name stays taken: invoices still carry it.
    taken = await api.client.post("/admin/tenants", json={"name": "acme"}, headers=ADMIN)
    assert taken.status_code == 409
    audit = await api.client.get(f"/admin/audit?target_id={tenant['id']}&limit=1", headers=ADMIN)
    [entry] = audit.json()["data"]
    assert (entry["action"], entry["details"]) == (
        "tenant.delete", {"name": "acme", "revoked_keys": 2, "deleted_adapters": 1}
    )


# ------------------------------------------------------------------------------- audit


async def test_audit_log_records_actor_request_id_and_changes(api: Api) -> None:
    sent = {**ADMIN, "x-request-id": "req-create-1"}
    body = {"name": "acme", "quotas": {"rpm": 5}}
    tenant = (await api.client.post("/admin/tenants", json=body, headers=sent)).json()
    await api.client.patch(
        f"/admin/tenants/{tenant['id']}", json={"quotas": {"rpm": 7}, "tier": "premium"},
        headers={**ADMIN, "x-request-id": "req-patch-1"},
    )
    # A PATCH that changes nothing writes nothing.
    await api.client.patch(
        f"/admin/tenants/{tenant['id']}", json={"tier": "premium"}, headers=ADMIN
    )
    key = await new_key(api, tenant["id"])
    await api.client.delete(f"/admin/keys/{key['id']}", headers=ADMIN)

    response = await api.client.get("/admin/audit", headers=ADMIN)
    entries = response.json()["data"]
    assert [(e["action"], e["target_type"], e["target_id"], e["actor"]) for e in entries] == [
        ("key.revoke", "api_key", key["id"], "bootstrap"),
        ("key.create", "api_key", key["id"], "bootstrap"),
        ("tenant.update", "tenant", tenant["id"], "bootstrap"),
        ("tenant.create", "tenant", tenant["id"], "bootstrap"),
    ]
    assert entries[3]["request_id"] == "req-create-1"
    assert entries[3]["details"] == {
        "name": "acme", "tier": "standard", "isolation": "shared", "plan": None,
        "quotas": {
            "rpm": 5, "tpm": None, "max_concurrency": None, "monthly_tokens": None,
            "max_tokens": None, "max_context_tokens": None, "max_adapters": None,
        },
    }
    assert entries[2]["request_id"] == "req-patch-1"
    assert entries[2]["details"] == {"changes": {"rpm": [5, 7], "tier": ["standard", "premium"]}}
    assert entries[1]["details"] == {
        "tenant_id": tenant["id"], "is_admin": False, "name": "ci", "prefix": key["prefix"],
        "scopes": ["inference"], "expires_at": None,
    }
    assert all(len(e["request_id"]) == 32 for e in entries[:2])  # generated by the middleware
    limited = await api.client.get("/admin/audit?limit=2", headers=ADMIN)
    assert [e["id"] for e in limited.json()["data"]] == [entries[0]["id"], entries[1]["id"]]
    by_action = await api.client.get("/admin/audit?action=tenant.update", headers=ADMIN)
    assert [e["id"] for e in by_action.json()["data"]] == [entries[2]["id"]]
    bad = await api.client.get("/admin/audit?limit=0", headers=ADMIN)
    assert bad.json() == error("'limit' must be between 1 and 1000, got 0.", param="limit")
    with api.db() as session:
        assert len(session.scalars(select(AuditLog)).all()) == 4


async def test_a_refused_write_leaves_no_audit_row(api: Api) -> None:
    await new_tenant(api, "acme")
    await api.client.post("/admin/tenants", json={"name": "acme"}, headers=ADMIN)  # 409
    await api.client.post("/admin/tenants", json={"name": "x", "id": "y"}, headers=ADMIN)  # 400
    with api.db() as session:
        assert session.scalars(select(AuditLog.action)).all() == ["tenant.create"]

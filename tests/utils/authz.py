"""What the authorization matrix (tests/app/test_authz_matrix.py) is built from: the
routes an app registers, the callers it tries each route with, two tenants' objects
made through the real admin API, and the admin UI's sessions.

Every request goes over real HTTP to the app served in a thread; the client keeps no
cookies, so each request carries exactly the credentials its caller names.
"""

from __future__ import annotations

import io
import itertools
import time
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import httpx
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from starlette.routing import BaseRoute, Mount

from admin_ui import MOUNT
from admin_ui.sessions import CSRF_HEADER, SESSION_COOKIE
from admin_ui.throttle import LoginThrottle
from app.core.config import Settings
from app.core.security import generate_key
from app.main import create_app
from tests.admin_ui.pages import UI, form_csrf, page_csrf
from tests.utils.fake_engine import FakeEngine
from tests.utils.live_server import serve_in_thread
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer

ADMIN = bearer(ADMIN_KEY)
TENANT_HEADER = "X-Loraplex-Tenant"
INFERENCE = "inference"
ADAPTERS_WRITE = "adapters:write"
ALL_SCOPES = frozenset({INFERENCE, ADAPTERS_WRITE})
# Seconds the expiring keys live: long enough to log a UI session in with one.
EXPIRY_S = 3.0


# ----------------------------------------------------------------------------- routes


def route_keys(routes: Sequence[BaseRoute]) -> list[str]:
    """Each route as "METHOD /path/{param}" (HEAD of a GET route left out) and each
    mounted app as "MOUNT /path", as the app dispatches them."""
    keys: list[str] = []
    for context in iter_route_contexts(routes):
        if isinstance(context.original_route, Mount):
            keys.append(f"MOUNT {context.path}")
            continue
        methods = set(context.methods or ())
        if "GET" in methods:
            methods.discard("HEAD")
        assert methods, f"a route without methods: {context.path}"
        keys.extend(f"{method} {context.path}" for method in sorted(methods))
    return keys


def unlisted_routes(routes: Sequence[BaseRoute], listed: set[str]) -> list[str]:
    return [key for key in route_keys(routes) if key not in listed]


# ---------------------------------------------------------------------------- callers

Kind = Literal["nobody", "tenant", "admin"]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sends a request, and with what credentials.

    `kind`, `tenant` and `scopes` say what the server should take the caller for:
    "nobody" is anyone whose credentials must not authenticate (missing, malformed,
    expired, revoked, a disabled or deleted tenant's key, a UI cookie on the API)."""

    name: str
    kind: Kind
    tenant: str | None = None  # "a" or "b": whose key it is
    scopes: frozenset[str] = frozenset()
    key: str | None = None  # sent as a bearer key, and posted to the UI's login form
    scheme: str = "Bearer"
    act_for: str | None = None  # sends X-Loraplex-Tenant: "a" (its id) or "deleted"
    cookie: str | None = None  # the admin UI's session cookie
    ui: bool = False  # the cookie is a session the UI must accept
    csrf: str | None = None  # a CSRF token, sent with the UI's writes
    csrf_of_session: bool = True  # False: the token is another session's
    login_key: str | None = None  # the admin key that opened the session
    accept_json: bool = False

    def has(self, scope: str) -> bool:
        return self.kind == "admin" or scope in self.scopes


# ---------------------------------------------------------------------------- objects


@dataclass(slots=True)
class Owned:
    """One tenant's (or the shared) objects, and the strings that identify them."""

    tenant_id: str = ""
    tenant_name: str = ""
    plan: str = ""
    adapter_id: str = ""
    adapter_name: str = ""
    version_id: str = ""
    invoice_id: str = ""
    key_ids: list[str] = field(default_factory=list)
    key_prefixes: list[str] = field(default_factory=list)

    def markers(self) -> set[str]:
        """What must never reach another tenant."""
        found = {self.tenant_id, self.tenant_name, self.adapter_id, self.adapter_name,
                 self.version_id, self.invoice_id, *self.key_ids, *self.key_prefixes}
        return {m for m in found if m}


@dataclass(slots=True)
class World:
    """The served app with tenants a and b, shared objects, and every caller's key."""

    app: FastAPI
    client: httpx.Client
    engine: FakeEngine
    owned: dict[str, Owned]  # "a", "b", "shared"
    callers: dict[str, Caller] = field(default_factory=dict)
    admin_key_id: str = ""
    deleted_tenant_id: str = ""
    _serial: Iterator[int] = field(default_factory=itertools.count)
    _months: Iterator[int] = field(default_factory=itertools.count)

    def serial(self) -> int:
        return next(self._serial)

    def send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        self.client.cookies.clear()
        return self.client.request(method, path, **kwargs)

    def admin(self, method: str, path: str, expect: int, **kwargs: Any) -> Any:
        response = self.send(method, path, headers=ADMIN, **kwargs)
        assert response.status_code == expect, (method, path, response.text)
        return response.json() if response.content else None

    # -- made through the admin API ---------------------------------------------------

    def new_tenant(self, name: str, plan: str | None = None) -> str:
        body: dict[str, Any] = {"name": name, "tier": "standard", "isolation": "shared",
                                "quotas": {}, "plan": plan}
        return str(self.admin("POST", "/admin/tenants", 201, json=body)["id"])

    def new_key(self, tenant_id: str | None, *, scopes: Sequence[str] = (INFERENCE,),
                expires_at: datetime | None = None) -> tuple[str, str, str]:
        """(id, key, prefix) of a new tenant key, or admin key for tenant_id None."""
        body: dict[str, Any] = {"name": f"key-{self.serial()}"}
        if expires_at is not None:
            body["expires_at"] = expires_at.isoformat()
        if tenant_id is None:
            made = self.admin("POST", "/admin/keys", 201, json=body)
        else:
            made = self.admin("POST", f"/admin/tenants/{tenant_id}/keys", 201,
                              json={**body, "scopes": list(scopes)})
        return str(made["id"]), str(made["key"]), str(made["prefix"])

    def new_adapter(self, tenant_id: str | None, name: str | None = None) -> tuple[str, str]:
        """(adapter id, version id) of a new ready adapter (shared for tenant_id None).

        NOTE: the ids are read back from the list, not from the upload's body, whose
        shape is not what this test is about."""
        name = name or f"made-{self.serial()}"
        fields = {"name": name} if tenant_id is None else {"name": name, "tenant_id": tenant_id}
        self.admin("POST", "/admin/adapters", 201, files=upload_files(self.serial()), data=fields)
        owner = tenant_id or "shared"
        listed = self.admin("GET", f"/admin/adapters?tenant_id={owner}", 200)["data"]
        adapter = next(a for a in listed if a["name"] == name)
        assert adapter["versions"][-1]["status"] == "ready", adapter
        return str(adapter["id"]), str(adapter["versions"][-1]["id"])

    def new_invoice(self, tenant_id: str, period: str | None = None) -> str:
        if period is None:  # a past month of its own, so that it can be finalized
            n = next(self._months)
            period = f"{2001 + n // 12}-{n % 12 + 1:02d}"
        made = self.admin("POST", "/admin/invoices", 200,
                          json={"tenant_id": tenant_id, "period": period})
        return str(made["id"])

    # -- the admin UI -------------------------------------------------------------------

    def login(self, key: str) -> tuple[str, str]:
        """(session cookie, CSRF token) of a new admin UI session opened with `key`."""
        form = self.send("GET", f"{UI}/login")
        assert form.status_code == 200, form.text
        login_csrf = form.cookies["lpx_admin_login_csrf"]
        self.client.cookies.clear()
        done = self.client.post(
            f"{UI}/login", data={"key": key, "csrf_token": form_csrf(form.text), "next": ""},
            headers={"Cookie": f"lpx_admin_login_csrf={login_csrf}"},
        )
        assert done.status_code == 303, done.text
        cookie = done.cookies[SESSION_COOKIE]
        page = self.send("GET", f"{UI}/", headers={"Cookie": f"{SESSION_COOKIE}={cookie}"})
        assert page.status_code == 200, page.text
        return cookie, page_csrf(page.text)

    def logout(self, cookie: str, csrf: str) -> None:
        done = self.send("POST", f"{UI}/logout", data={"csrf_token": csrf},
                         headers={"Cookie": f"{SESSION_COOKIE}={cookie}"})
        assert done.status_code == 303, done.text


def upload_files(seed: int) -> dict[str, tuple[str, bytes, str]]:
    """The file part of an upload: a .zip of a distinct small adapter (the fake engine
    takes any config and weights)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("adapter_config.json", f'{{"peft_type": "LORA", "r": 8, "n": {seed}}}')
        archive.writestr("adapter_model.safetensors", f"weights-{seed}")
    return {"file": ("adapter.zip", buffer.getvalue(), "application/zip")}


def csrf_header(caller: Caller) -> dict[str, str]:
    return {} if caller.csrf is None else {CSRF_HEADER: caller.csrf}


# ------------------------------------------------------------------------------ setup


def _callers(keys: dict[str, str], sessions: dict[str, tuple[str, str]]) -> dict[str, Caller]:
    bootstrap_cookie, bootstrap_csrf = sessions["bootstrap"]
    db_cookie, db_csrf = sessions["db-admin"]
    callers = [
        Caller("anonymous", "nobody"),
        Caller("anonymous-json", "nobody", accept_json=True),
        Caller("malformed-key", "nobody", key="lpx_t_" + "0" * 32 + "_bad"),
        Caller("not-a-loraplex-key", "nobody", key="sk-" + "0" * 48),
        Caller("basic-scheme", "nobody", key=keys["a-inference"], scheme="Basic"),
        # Well-formed (its checksum holds) but never issued.
        Caller("unknown-key", "nobody", key=generate_key("t", SECRET_KEY).key),
        Caller("expired-key", "nobody", key=keys["a-expired"]),
        Caller("revoked-key", "nobody", key=keys["a-revoked"]),
        Caller("disabled-tenant-key", "nobody", key=keys["disabled"]),
        Caller("deleted-tenant-key", "nobody", key=keys["deleted"]),
        Caller("expired-admin-key", "nobody", key=keys["admin-expired"]),
        Caller("revoked-admin-key", "nobody", key=keys["admin-revoked"]),
        Caller("a-inference", "tenant", "a", frozenset({INFERENCE}), key=keys["a-inference"]),
        Caller("a-writer", "tenant", "a", frozenset({ADAPTERS_WRITE}), key=keys["a-writer"]),
        Caller("b-both-scopes", "tenant", "b", ALL_SCOPES, key=keys["b-both"]),
        Caller("b-acting-for-a", "tenant", "b", ALL_SCOPES, key=keys["b-both"], act_for="a"),
        Caller("admin-bootstrap", "admin", key=ADMIN_KEY),
        Caller("admin-db-key", "admin", key=keys["admin-db"]),
        Caller("admin-acting-for-a", "admin", key=ADMIN_KEY, act_for="a"),
        Caller("admin-acting-for-deleted", "admin", key=keys["admin-db"], act_for="deleted"),
        # The admin UI's sessions, which the API must not take for credentials.
        Caller("ui-forged-cookie", "nobody", cookie=bootstrap_cookie[:-4] + "AAAA"),
        Caller("ui-revoked-admin", "nobody", cookie=sessions["revoked"][0]),
        Caller("ui-expired-admin", "nobody", cookie=sessions["expired"][0]),
        Caller("ui-logged-out", "nobody", cookie=sessions["logged-out"][0]),
        Caller("ui-bootstrap", "nobody", cookie=bootstrap_cookie, ui=True,
               csrf=bootstrap_csrf, login_key=ADMIN_KEY),
        Caller("ui-db-admin", "nobody", cookie=db_cookie, ui=True, csrf=db_csrf,
               login_key=keys["admin-db"]),
        Caller("ui-without-csrf", "nobody", cookie=bootstrap_cookie, ui=True,
               login_key=ADMIN_KEY),
        Caller("ui-another-sessions-csrf", "nobody", cookie=db_cookie, ui=True,
               csrf=bootstrap_csrf, csrf_of_session=False, login_key=keys["admin-db"]),
    ]
    return {c.name: c for c in callers}


def _tenants(world: World) -> None:
    """Tenants a and b, each with a plan and an adapter, and a shared adapter."""
    for who, word in (("a", "alpha"), ("b", "bravo")):
        owned = world.owned[who]
        owned.plan = f"plan-{word}"
        world.admin("POST", "/admin/plans", 201, json={
            "name": owned.plan, "currency": "USD", "prompt_per_mtok": "1.00",
            "completion_per_mtok": "2.00", "cached_prompt_per_mtok": "0.50",
            "adapter_month": "3.00", "monthly_minimum": "0.00",
        })
        owned.tenant_name = f"tenant-{word}-{world.serial()}"
        owned.tenant_id = world.new_tenant(owned.tenant_name, owned.plan)
        owned.adapter_name = f"{word}-bot"
        owned.adapter_id, owned.version_id = world.new_adapter(
            owned.tenant_id, owned.adapter_name
        )
    shared = world.owned["shared"]
    shared.adapter_name = "shared-bot"
    shared.adapter_id, shared.version_id = world.new_adapter(None, shared.adapter_name)


def _keys(world: World, expires: datetime) -> tuple[dict[str, str], dict[str, str]]:
    """Every role's key, and its id (and the disabled and deleted tenants' ids)."""
    a, b = world.owned["a"], world.owned["b"]
    made = {
        "a-inference": (a, [INFERENCE], None),
        "a-writer": (a, [ADAPTERS_WRITE], None),
        "a-expired": (a, [INFERENCE, ADAPTERS_WRITE], expires),
        "a-revoked": (a, [INFERENCE, ADAPTERS_WRITE], None),
        "b-both": (b, [INFERENCE, ADAPTERS_WRITE], None),
    }
    keys: dict[str, str] = {}
    ids: dict[str, str] = {}
    for role, (owner, scopes, expires_at) in made.items():
        ids[role], keys[role], prefix = world.new_key(
            owner.tenant_id, scopes=scopes, expires_at=expires_at
        )
        owner.key_ids.append(ids[role])
        owner.key_prefixes.append(prefix)
    for role in ("disabled", "deleted"):
        tenant_id = world.new_tenant(f"tenant-{role}-{world.serial()}")
        ids[role], keys[role], _ = world.new_key(tenant_id, scopes=sorted(ALL_SCOPES))
        ids[f"{role}-tenant"] = tenant_id
    for role, expires_at in (("admin-db", None), ("admin-expired", expires),
                             ("admin-revoked", None), ("admin-ui-revoked", None)):
        ids[role], keys[role], _ = world.new_key(None, expires_at=expires_at)
    world.admin_key_id = ids["admin-db"]
    world.deleted_tenant_id = ids["deleted-tenant"]
    return keys, ids


def _usage_and_invoices(world: World, keys: dict[str, str]) -> None:
    """Usage rows of both tenants (base model and their adapter), then this month's
    invoice of each."""
    for who, role in (("a", "a-inference"), ("b", "b-both")):
        for model in (world.engine.model_id, world.owned[who].adapter_name):
            done = world.send("POST", "/v1/completions", headers=bearer(keys[role]),
                              json={"model": model, "prompt": "hi", "max_tokens": 2})
            assert done.status_code == 200, done.text
    tenant_ids = [world.owned[who].tenant_id for who in ("a", "b")]
    deadline = time.monotonic() + 10
    for tenant_id in tenant_ids:
        while not world.admin("GET", f"/admin/usage?tenant_id={tenant_id}", 200)["data"]:
            assert time.monotonic() < deadline, f"no usage rows of {tenant_id} were written"
            time.sleep(0.05)
    this_month = datetime.now(UTC).strftime("%Y-%m")
    for who in ("a", "b"):
        owned = world.owned[who]
        owned.invoice_id = world.new_invoice(owned.tenant_id, this_month)


@contextmanager
def built_world(root: Path) -> Iterator[World]:
    """The app on SQLite and the fake engine, served over HTTP, with:

    tenants a and b (each a plan, a ready adapter, usage rows and an invoice), a shared
    adapter, a disabled and a deleted tenant with a key each, keys of every kind, and
    admin UI sessions (valid, revoked, expired, logged out)."""
    engine = FakeEngine()
    settings = Settings(
        data_dir=root / "data", database_url=f"sqlite:///{root / 'db.sqlite'}",
        admin_key=ADMIN_KEY, secret_key=SECRET_KEY, usage_flush_interval_s=0.05,
    )
    app = create_app(engine, settings, mounts=[MOUNT])
    # NOTE: the matrix posts many refused logins from one address; the throttle has
    # tests of its own (tests/admin_ui/test_auth_http.py).
    app.state.admin_ui.throttle = LoginThrottle(max_failures=10**9)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        world = World(app, client, engine, {"a": Owned(), "b": Owned(), "shared": Owned()})
        _tenants(world)
        expires = datetime.now(UTC) + timedelta(seconds=EXPIRY_S)
        keys, ids = _keys(world, expires)
        sessions = {
            "expired": world.login(keys["admin-expired"]),  # first: its key expires soon
            "bootstrap": world.login(ADMIN_KEY),
            "db-admin": world.login(keys["admin-db"]),
            "revoked": world.login(keys["admin-ui-revoked"]),
            "logged-out": world.login(ADMIN_KEY),
        }
        world.logout(*sessions["logged-out"])
        _usage_and_invoices(world, keys)
        for role in ("a-revoked", "admin-revoked", "admin-ui-revoked"):
            world.admin("DELETE", f"/admin/keys/{ids[role]}", 204)
        world.admin("PATCH", f"/admin/tenants/{ids['disabled-tenant']}", 200,
                    json={"disabled": True})
        world.admin("DELETE", f"/admin/tenants/{ids['deleted-tenant']}", 204)
        world.callers = _callers(keys, sessions)
        while datetime.now(UTC) < expires + timedelta(seconds=0.1):
            time.sleep(0.05)
        yield world

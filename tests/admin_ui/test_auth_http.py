"""The admin UI's login, session cookie and CSRF checks over HTTP through the whole app,
on SQLite and PostgreSQL: who may log in, what the cookie holds and how it is flagged,
that a session ends when it expires, is logged out, or its admin key is revoked, and
that no change goes through without the session's CSRF token."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from fastapi import FastAPI

from admin_ui import MOUNT
from admin_ui.sessions import BOOTSTRAP, LOGIN_CSRF_COOKIE, SESSION_COOKIE
from admin_ui.web import AdminUI
from app.core.config import Settings
from app.main import create_app
from tests.admin_ui.pages import UI, csrf_of, form_csrf, login, set_cookie_headers
from tests.utils.fake_engine import FakeEngine, asgi_client
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer

ADMIN = bearer(ADMIN_KEY)
PAGES = ("/", "/tenants", "/adapters", "/playground", "/usage", "/invoices")


@dataclass
class Served:
    app: FastAPI
    client: httpx.AsyncClient

    @property
    def ui(self) -> AdminUI:
        ui = self.app.state.admin_ui
        assert isinstance(ui, AdminUI)
        return ui

    async def tenant_names(self) -> set[str]:
        listed = await self.client.get("/admin/tenants", headers=ADMIN)
        assert listed.status_code == 200, listed.text
        return {t["name"] for t in listed.json()["data"]}

    async def audit(self, action: str) -> list[dict[str, Any]]:
        rows = await self.client.get(f"/admin/audit?action={action}", headers=ADMIN)
        assert rows.status_code == 200, rows.text
        return list(rows.json()["data"])


def _settings(database_url: str, data_dir: Path, **overrides: Any) -> Settings:
    fields: dict[str, Any] = {
        "data_dir": data_dir, "database_url": database_url, "admin_key": ADMIN_KEY,
        "secret_key": SECRET_KEY, **overrides,
    }
    return Settings(**fields)


@asynccontextmanager
async def _serve(settings: Settings, base_url: str = "http://testserver"
                 ) -> AsyncIterator[Served]:
    app = create_app(FakeEngine(), settings, mounts=[MOUNT])
    async with asgi_client(app) as client:
        client.base_url = httpx.URL(base_url)
        yield Served(app, client)


@pytest.fixture
async def served(database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    async with _serve(_settings(database_url, tmp_path / "data")) as s:
        yield s


@pytest.fixture
async def served_sqlite(sqlite_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    async with _serve(_settings(sqlite_url, tmp_path / "data")) as s:
        yield s


async def _create_tenant_form(served: Served, name: str, **extra: str) -> httpx.Response:
    return await served.client.post(
        f"{UI}/tenants", data={"name": name, "tier": "standard", "isolation": "shared",
                               "plan": "", **extra},
    )


# ------------------------------------------------------------------------------ logins


async def test_pages_redirect_to_login_until_logged_in(served: Served) -> None:
    for page in PAGES:
        response = await served.client.get(UI + page)
        assert response.status_code == 303, (page, response.text)
        assert response.headers["location"].startswith(f"{UI}/login?next=")
    # Scripts get a 401 instead of a redirect; a change without a session changes nothing.
    scripted = await served.client.get(f"{UI}/tenants", headers={"Accept": "application/json"})
    assert scripted.status_code == 401
    assert scripted.json()["error"]["code"] == "login_required"
    refused = await _create_tenant_form(served, "no-session")
    assert refused.status_code == 303
    assert refused.headers["location"] == f"{UI}/login"
    assert "no-session" not in await served.tenant_names()

    # After logging in, the redirect target is where the login sends the browser back.
    redirected = await served.client.get(f"{UI}/usage?group_by=key")
    target = unquote(redirected.headers["location"].split("next=", 1)[1])
    logged_in = await login(served.client, ADMIN_KEY, next_path=target)
    assert logged_in.status_code == 303
    assert logged_in.headers["location"] == f"{UI}/usage?group_by=key"
    for page in PAGES:
        response = await served.client.get(UI + page)
        assert response.status_code == 200, (page, response.text)
        assert 'aria-current="page"' in response.text or page == "/"


async def test_login_cookie_is_httponly_strict_signed_and_holds_no_key(served: Served) -> None:
    response = await login(served.client, ADMIN_KEY)
    assert response.status_code == 303
    assert response.headers["location"] == f"{UI}/"
    (cookie,) = set_cookie_headers(response, SESSION_COOKIE)
    flags = [part.strip().lower() for part in cookie.split(";")]
    assert "httponly" in flags
    assert "samesite=strict" in flags
    assert "path=/admin/ui" in flags
    assert "secure" not in flags  # plain http, development
    max_age = next(int(f.split("=")[1]) for f in flags if f.startswith("max-age="))
    assert 0 < max_age <= 24 * 3600
    value = cookie.split(";")[0].split("=", 1)[1]
    assert ADMIN_KEY not in value and ADMIN_KEY[:12] not in value
    session = served.ui.signer.read(value, now=int(time.time()))
    assert session is not None and session.actor == BOOTSTRAP
    # The login form's token cookie is spent.
    assert any("max-age=0" in h.lower() for h in set_cookie_headers(response, LOGIN_CSRF_COOKIE))
    overview = await served.client.get(f"{UI}/")
    assert overview.status_code == 200
    assert "Signed in as <code>bootstrap</code>" in overview.text
    assert "default-src 'self'" in overview.headers["content-security-policy"]


@pytest.mark.parametrize(
    ("base_url", "environment"),
    [("https://testserver", "development"), ("http://testserver", "production")],
)
async def test_cookie_is_secure_over_https_and_in_production(
    sqlite_url: str, tmp_path: Path, base_url: str, environment: str
) -> None:
    settings = _settings(sqlite_url, tmp_path / "data", environment=environment)
    async with _serve(settings, base_url) as served:
        form = await served.client.get(f"{UI}/login")
        (login_cookie,) = set_cookie_headers(form, LOGIN_CSRF_COOKIE)
        assert "secure" in [p.strip().lower() for p in login_cookie.split(";")]
        # Sent by hand: over plain http (production behind a TLS proxy) a client keeps
        # secure cookies to itself.
        token = form_csrf(form.text)
        response = await served.client.post(
            f"{UI}/login", data={"key": ADMIN_KEY, "csrf_token": token},
            headers={"Cookie": f"{LOGIN_CSRF_COOKIE}={token}"},
        )
        assert response.status_code == 303, response.text
        (cookie,) = set_cookie_headers(response, SESSION_COOKIE)
        assert "secure" in [p.strip().lower() for p in cookie.split(";")]


async def test_wrong_keys_cannot_log_in(served: Served) -> None:
    tenant = (await served.client.post(
        "/admin/tenants", json={"name": "acme"}, headers=ADMIN)).json()
    tenant_key = (await served.client.post(
        f"/admin/tenants/{tenant['id']}/keys", json={"name": "k"}, headers=ADMIN)).json()["key"]
    cases = {
        "not-the-admin-key-0123456789": "Login failed",
        ADMIN_KEY[:-1] + "x": "Login failed",
        tenant_key: "belongs to a tenant",
        "": "Enter an admin key",
    }
    for key, message in cases.items():
        response = await login(served.client, key)
        assert response.status_code == 401, (key, response.text)
        assert message in response.text
        assert set_cookie_headers(response, SESSION_COOKIE) == []
        assert SESSION_COOKIE not in served.client.cookies
        follow = await served.client.get(f"{UI}/tenants")
        assert follow.status_code == 303


async def test_login_form_needs_its_own_token(served_sqlite: Served) -> None:
    client = served_sqlite.client
    await client.get(f"{UI}/login")
    for token in (None, "forged", "förged"):
        data = {"key": ADMIN_KEY, **({"csrf_token": token} if token else {})}
        response = await client.post(f"{UI}/login", data=data)
        assert response.status_code == 403, response.text
        assert set_cookie_headers(response, SESSION_COOKIE) == []


async def test_login_goes_only_to_pages_of_the_ui(served_sqlite: Served) -> None:
    for target in ("https://evil.example/", "//evil.example/", f"{UI}/login", "/admin/tenants"):
        served_sqlite.client.cookies.clear()
        response = await login(served_sqlite.client, ADMIN_KEY, next_path=target)
        assert response.headers["location"] == f"{UI}/", target


async def test_repeated_failures_are_throttled(served_sqlite: Served) -> None:
    client = served_sqlite.client
    throttle = served_sqlite.ui.throttle
    for _ in range(throttle.max_failures):
        assert (await login(client, "wrong-key-0123456789abcdef")).status_code == 401
    # Even the right key waits now.
    blocked = await login(client, ADMIN_KEY)
    assert blocked.status_code == 429
    assert int(blocked.headers["retry-after"]) > 0
    assert "Too many failed logins" in blocked.text
    assert set_cookie_headers(blocked, SESSION_COOKIE) == []


# -------------------------------------------------------------------------------- CSRF


async def test_changes_need_the_sessions_csrf_token(served: Served) -> None:
    await login(served.client, ADMIN_KEY)
    token = await csrf_of(served.client)
    # One character changed, whatever the token's first character is.
    wrong = ("y" if token[0] == "x" else "x") + token[1:]
    assert wrong != token
    for name, extra, headers in (
        ("no-token", {}, {}),
        ("wrong-token", {"csrf_token": wrong}, {}),
        ("wrong-header", {}, {"X-CSRF-Token": "nope"}),
    ):
        response = await served.client.post(
            f"{UI}/tenants",
            data={"name": name, "tier": "standard", "isolation": "shared", "plan": "", **extra},
            headers=headers,
        )
        assert response.status_code == 403, (name, response.text)
        assert "CSRF" in response.text
    assert await served.tenant_names() == set()
    assert await served.audit("tenant.create") == []

    # A token of another session does not carry over.
    other = httpx.AsyncClient(transport=httpx.ASGITransport(app=served.app),
                              base_url="http://testserver")
    async with other:
        await login(other, ADMIN_KEY)
        other_token = await csrf_of(other)
    assert other_token != token
    refused = await _create_tenant_form(served, "other-token", csrf_token=other_token)
    assert refused.status_code == 403

    created = await _create_tenant_form(served, "with-token", csrf_token=token)
    assert created.status_code == 303, created.text
    header = await served.client.post(
        f"{UI}/tenants", data={"name": "via-header", "tier": "batch", "isolation": "shared",
                               "plan": ""}, headers={"X-CSRF-Token": token},
    )
    assert header.status_code == 303
    assert await served.tenant_names() == {"with-token", "via-header"}
    audited = await served.audit("tenant.create")
    assert {row["actor"] for row in audited} == {"bootstrap"}


async def test_upload_needs_the_csrf_header(served_sqlite: Served) -> None:
    await login(served_sqlite.client, ADMIN_KEY)
    token = await csrf_of(served_sqlite.client)
    files = {"file": ("a.zip", b"PK\x05\x06" + b"\0" * 18, "application/zip")}
    refused = await served_sqlite.client.post(
        f"{UI}/adapters/upload", files=files, data={"name": "x", "csrf_token": token},
        headers={"Accept": "application/json"},
    )
    assert refused.status_code == 403
    assert "CSRF" in refused.json()["error"]["message"]
    listed = await served_sqlite.client.get("/admin/adapters", headers=ADMIN)
    assert listed.json()["data"] == []


# ---------------------------------------------------------------------- ending sessions


async def test_expired_or_tampered_sessions_are_logged_out(served_sqlite: Served) -> None:
    client, signer = served_sqlite.client, served_sqlite.ui.signer
    fingerprint = signer.bootstrap_fingerprint(ADMIN_KEY)
    now = int(time.time())
    _, expired = signer.issue(BOOTSTRAP, now=now - 3600, ttl_s=60, key_fingerprint=fingerprint)
    _, fresh = signer.issue(BOOTSTRAP, now=now, ttl_s=60, key_fingerprint=fingerprint)
    body, mac = fresh.split(".")
    cases = {
        "expired": expired,
        "tampered": body[:-2] + ("AA" if body[-2:] != "AA" else "BB") + "." + mac,
        "unsigned": body + ".",
        "no fingerprint": signer.issue(BOOTSTRAP, now=now)[1],
    }
    for case, value in cases.items():
        client.cookies.set(SESSION_COOKIE, value, path="/admin/ui")
        response = await client.get(f"{UI}/tenants")
        assert response.status_code == 303, case
    client.cookies.set(SESSION_COOKIE, fresh, path="/admin/ui")
    assert (await client.get(f"{UI}/tenants")).status_code == 200


async def test_revoking_the_admin_key_ends_its_sessions(served: Served) -> None:
    created = await served.client.post("/admin/keys", json={"name": "ops"}, headers=ADMIN)
    assert created.status_code == 201, created.text
    key_id, key = created.json()["id"], created.json()["key"]
    response = await login(served.client, key)
    assert response.status_code == 303, response.text
    (cookie,) = set_cookie_headers(response, SESSION_COOKIE)
    assert key not in cookie
    session = served.ui.signer.read(cookie.split(";")[0].split("=", 1)[1], now=int(time.time()))
    assert session is not None and session.actor == key_id
    token = await csrf_of(served.client)
    made = await _create_tenant_form(served, "by-ops", csrf_token=token)
    assert made.status_code == 303
    assert {row["actor"] for row in await served.audit("tenant.create")} == {key_id}

    revoked = await served.client.delete(f"/admin/keys/{key_id}", headers=ADMIN)
    assert revoked.status_code == 204
    assert (await served.client.get(f"{UI}/")).status_code == 303
    late = await _create_tenant_form(served, "after-revoke", csrf_token=token)
    assert late.status_code == 303 and late.headers["location"] == f"{UI}/login"
    assert "after-revoke" not in await served.tenant_names()
    assert (await login(served.client, key)).status_code == 401


async def test_a_new_bootstrap_key_ends_the_old_ones_sessions(
    sqlite_url: str, tmp_path: Path
) -> None:
    cookie = None
    async with _serve(_settings(sqlite_url, tmp_path / "data")) as served:
        await login(served.client, ADMIN_KEY)
        cookie = served.client.cookies[SESSION_COOKIE]
    assert cookie is not None
    rotated = _settings(sqlite_url, tmp_path / "data", admin_key="rotated-admin-key-0123456789")
    async with _serve(rotated) as served:
        served.client.cookies.set(SESSION_COOKIE, cookie, path="/admin/ui")
        assert (await served.client.get(f"{UI}/")).status_code == 303


async def test_logout_ends_the_session(served_sqlite: Served) -> None:
    client = served_sqlite.client
    await login(client, ADMIN_KEY)
    cookie = client.cookies[SESSION_COOKIE]
    page = await client.get(f"{UI}/")
    # Logging out is a change too: it needs the token.
    assert (await client.post(f"{UI}/logout")).status_code == 403
    response = await client.post(f"{UI}/logout", data={"csrf_token": form_csrf(page.text)})
    assert response.status_code == 303
    assert response.headers["location"] == f"{UI}/login"
    assert any("max-age=0" in h.lower() for h in set_cookie_headers(response, SESSION_COOKIE))
    # The old cookie, replayed, is refused by the server too.
    client.cookies.set(SESSION_COOKIE, cookie, path="/admin/ui")
    assert (await client.get(f"{UI}/")).status_code == 303


async def test_without_auth_the_local_admin_logs_in_with_no_key(
    sqlite_url: str, tmp_path: Path
) -> None:
    settings = _settings(sqlite_url, tmp_path / "data", no_auth=True, admin_key=None)
    async with _serve(settings) as served:
        form = await served.client.get(f"{UI}/login")
        assert "runs without API keys" in form.text
        response = await login(served.client, "")
        assert response.status_code == 303, response.text
        overview = await served.client.get(f"{UI}/")
        assert "Signed in as <code>local</code>" in overview.text
        created = await _create_tenant_form(
            served, "local-made", csrf_token=await csrf_of(served.client))
        assert created.status_code == 303
        assert {row["actor"] for row in await served.audit("tenant.create")} == {"local"}

"""GET /v1/usage and GET /admin/usage over HTTP on SQLite and PostgreSQL: records go in
through the UsageRecorder, reports come out grouped by day, adapter and key, as JSON and
CSV, each tenant seeing only its own usage."""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from app.api.errors import APIError, install_exception_handlers
from app.api.middleware import RequestContextMiddleware
from app.api.routes import usage
from app.api.routes.usage import time_range
from app.api.state import AppState
from app.audit import AuditContext
from app.core.config import Settings
from app.db import make_engine, session_factory, session_scope
from app.directory import Directory
from app.metering import UsageEvent, UsageRecorder
from app.metrics import Metrics
from app.tables import Adapter, Scope, UsageStatus, new_id
from app.tenants import create_admin_key, create_tenant, create_tenant_key
from tests.utils.fake_engine import FakeEngine, asgi_client
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer

BY = AuditContext(actor="test")
MAR_1 = datetime(2026, 3, 1, tzinfo=UTC)
MAR_2 = datetime(2026, 3, 2, tzinfo=UTC)
MAR_3 = datetime(2026, 3, 3, tzinfo=UTC)
RANGE = {"start": "2026-03-01", "end": "2026-03-03"}


@dataclass
class Service:
    client: httpx.AsyncClient
    tenant_a: str
    tenant_b: str
    adapter_a: str
    key_a1: str  # key ids
    key_a2: str
    key_b: str
    a1: str  # plaintext keys
    a_writer: str  # adapters:write only
    b: str
    admin: str  # an admin key from the database (the bootstrap one is ADMIN_KEY)


def build_app(db: sessionmaker[Session], directory: Directory, settings: Settings) -> FastAPI:
    engine = FakeEngine()
    metrics = Metrics(engine)
    app = FastAPI()
    app.state.loraplex = AppState(
        engine=engine, settings=settings, metrics=metrics, db=db, directory=directory,
        limiter=cast(Any, None), usage=cast(Any, None), registry=cast(Any, None),
        evals=cast(Any, None),
    )
    install_exception_handlers(app)
    app.add_middleware(RequestContextMiddleware, max_body_bytes=settings.max_body_bytes,
                       metrics=metrics)
    app.include_router(usage.router)
    return app


def event(request_id: str, tenant: str, key: str, at: datetime, *, adapter: str | None,
          prompt: int, completion: int, cached: int, status: UsageStatus) -> UsageEvent:
    return UsageEvent(
        request_id=request_id, tenant_id=tenant, key_id=key,
        model="support-bot" if adapter else "fake-model", adapter_id=adapter,
        adapter_version=1 if adapter else None, prompt_tokens=prompt,
        completion_tokens=completion, cached_tokens=cached, ttft_ms=1.0, latency_ms=2.0,
        status=status, created_at=at,
    )


@pytest.fixture
async def service(database_url: str, tmp_path: Path) -> AsyncIterator[Service]:
    if make_url(database_url).get_backend_name() == "postgresql":
        # A session time zone far from UTC: days must still be UTC days.
        engine = make_engine(database_url, connect_args={
            "connect_timeout": 5, "options": "-c timezone=Pacific/Auckland"})
    else:
        engine = make_engine(database_url)
    db = session_factory(engine)
    with session_scope(db) as session:
        ta = create_tenant(session, name="acme", by=BY).id
        tb = create_tenant(session, name="globex", by=BY).id
        a1 = create_tenant_key(session, secret=SECRET_KEY, tenant_id=ta, name="prod", by=BY)
        a2 = create_tenant_key(session, secret=SECRET_KEY, tenant_id=ta, name="=cmd|calc",
                               by=BY)
        writer = create_tenant_key(session, secret=SECRET_KEY, tenant_id=ta, name="ci",
                                   scopes=[Scope.ADAPTERS_WRITE], by=BY)
        b = create_tenant_key(session, secret=SECRET_KEY, tenant_id=tb, name="b", by=BY)
        admin = create_admin_key(session, secret=SECRET_KEY, name="ops", by=BY)
        adapter = Adapter(id=new_id("ad"), tenant_id=ta, owner=ta, name="support-bot")
        session.add(adapter)
        keys = (a1.row.id, a2.row.id, b.row.id)
        plain = (a1.key, writer.key, b.key, admin.key)
        adapter_id = adapter.id
    k1, k2, kb = keys
    ok, aborted, error = UsageStatus.OK, UsageStatus.ABORTED, UsageStatus.ERROR
    recorder = UsageRecorder(db, tmp_path / "spool")
    recorder.start()
    for e in (
        event("r1", ta, k1, MAR_1, adapter=adapter_id, prompt=10, completion=5, cached=2,
              status=ok),
        event("r2", ta, k1, MAR_2 - timedelta(microseconds=1), adapter=None, prompt=20,
              completion=7, cached=0, status=aborted),
        event("r3", ta, k2, MAR_2, adapter=adapter_id, prompt=30, completion=11, cached=4,
              status=error),
        event("r4", ta, k1, MAR_2 + timedelta(hours=12), adapter=adapter_id, prompt=40,
              completion=13, cached=8, status=ok),
        # Just outside [start, end): never counted.
        event("r5", ta, k1, MAR_1 - timedelta(microseconds=1), adapter=None, prompt=500,
              completion=500, cached=0, status=ok),
        event("r6", ta, k1, MAR_3, adapter=None, prompt=600, completion=600, cached=0,
              status=ok),
        # Tenant B.
        event("r7", tb, kb, MAR_1 + timedelta(hours=10), adapter=None, prompt=1000,
              completion=100, cached=0, status=ok),
        event("r8", tb, kb, MAR_2 + timedelta(hours=1), adapter=None, prompt=2000,
              completion=200, cached=0, status=error),
    ):
        recorder.record(e)
    assert recorder.flush(timeout_s=30)
    recorder.close()
    directory = Directory(db, secret=SECRET_KEY, admin_key=ADMIN_KEY, refresh_interval_s=0.5)
    directory.load()
    settings = Settings(data_dir=tmp_path, admin_key=ADMIN_KEY, secret_key=SECRET_KEY)
    async with asgi_client(build_app(db, directory, settings)) as client:
        yield Service(client, ta, tb, adapter_id, k1, k2, kb, *plain)
    engine.dispose()


def counts(requests: int, ok: int, aborted: int, error: int, prompt: int, completion: int,
           cached: int) -> dict[str, int]:
    return {
        "requests": requests, "requests_ok": ok, "requests_aborted": aborted,
        "requests_error": error, "prompt_tokens": prompt, "completion_tokens": completion,
        "cached_tokens": cached, "total_tokens": prompt + completion,
        "cost": None, "currency": None,  # these tenants have no price plan
    }


def row(tenant: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"tenant_id": tenant, "day": None, "adapter_id": None,
                            "adapter_name": None, "key_id": None, "key_name": None}
    return base | fields


A_TOTALS = counts(4, 2, 1, 1, 100, 36, 14)
B_TOTALS = counts(2, 1, 0, 1, 3000, 300, 0)


async def get(s: Service, path: str, key: str, **params: Any) -> httpx.Response:
    return await s.client.get(path, params=params, headers=bearer(key))


# ------------------------------------------------------------------ groupings


async def test_own_usage_by_day(service: Service) -> None:
    response = await get(service, "/v1/usage", service.a1, group_by="day", **RANGE)
    assert response.status_code == 200, response.text
    assert response.json() == {
        "object": "usage_report",
        "tenant_id": service.tenant_a,
        "start": "2026-03-01T00:00:00Z",
        "end": "2026-03-03T00:00:00Z",
        "group_by": "day",
        "data": [
            row(service.tenant_a, day="2026-03-01", **counts(2, 1, 1, 0, 30, 12, 2)),
            row(service.tenant_a, day="2026-03-02", **counts(2, 1, 0, 1, 70, 24, 12)),
        ],
        "totals": A_TOTALS,
    }


async def test_own_usage_by_adapter_and_by_key(service: Service) -> None:
    s = service
    response = await get(s, "/v1/usage", s.a1, group_by="adapter", **RANGE)
    assert response.status_code == 200, response.text
    assert response.json()["data"] == [
        row(s.tenant_a, **counts(1, 0, 1, 0, 20, 7, 0)),  # the base model first
        row(s.tenant_a, adapter_id=s.adapter_a, adapter_name="support-bot",
            **counts(3, 2, 0, 1, 80, 29, 14)),
    ]
    response = await get(s, "/v1/usage", s.a1, group_by="key", **RANGE)
    assert response.status_code == 200, response.text
    assert response.json()["data"] == sorted([
        row(s.tenant_a, key_id=s.key_a1, key_name="prod", **counts(3, 2, 1, 0, 70, 25, 10)),
        row(s.tenant_a, key_id=s.key_a2, key_name="=cmd|calc", **counts(1, 0, 0, 1, 30, 11, 4)),
    ], key=lambda r: r["key_id"])
    assert response.json()["totals"] == A_TOTALS
    response = await get(s, "/v1/usage", s.a1, **RANGE)
    assert response.json()["data"] == [row(s.tenant_a, **A_TOTALS)]


async def test_times_as_unix_seconds_and_offsets(service: Service) -> None:
    response = await get(
        service, "/v1/usage", service.a1,
        start=str(int(MAR_1.timestamp())), end="2026-03-03T01:00:00+01:00",
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["start"], body["end"]) == ("2026-03-01T00:00:00Z", "2026-03-03T00:00:00Z")
    assert body["totals"] == A_TOTALS
    # One microsecond later and r1 (at the very start) drops out.
    response = await get(service, "/v1/usage", service.a1,
                         start="2026-03-01T00:00:00.000001", end="2026-03-03")
    assert response.json()["totals"] == counts(3, 1, 1, 1, 90, 31, 12)


async def test_the_default_range_is_the_current_month(
    service: Service, database_url: str
) -> None:
    now = datetime.now(UTC)
    response = await get(service, "/v1/usage", service.b)
    assert response.status_code == 200, response.text
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    body = response.json()
    assert datetime.fromisoformat(body["start"]) == month
    assert datetime.fromisoformat(body["end"]) == (month + timedelta(days=32)).replace(day=1)
    assert body["data"] == []  # the fixture's usage is in March 2026
    assert body["totals"] == counts(0, 0, 0, 0, 0, 0, 0)


def test_time_range_defaults() -> None:
    now = datetime(2026, 12, 15, 8, 30, tzinfo=UTC)
    assert time_range(None, None, now=now) == (
        datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    assert time_range("2026-11-10", None, now=now) == (
        datetime(2026, 11, 10, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    assert time_range(None, "2026-03-01T00:00:00Z", now=now) == (
        datetime(2026, 2, 1, tzinfo=UTC), datetime(2026, 3, 1, tzinfo=UTC))
    assert time_range(None, "2026-03-15", now=now) == (
        datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 3, 15, tzinfo=UTC))
    # An unencoded '+' of an offset arrives as a space.
    assert time_range("2026-03-01T02:00:00 02:00", "2026-03-02", now=now)[0] == MAR_1
    with pytest.raises(APIError) as raised:
        time_range("2025-01-01", "2026-03-01", now=now)
    assert raised.value.param == "end"


# ------------------------------------------------------------------ isolation, auth


async def test_a_tenant_sees_only_its_own_usage(service: Service) -> None:
    s = service
    response = await get(s, "/v1/usage", s.b, group_by="key", **RANGE)
    assert response.json()["data"] == [
        row(s.tenant_b, key_id=s.key_b, key_name="b", **B_TOTALS)]
    # Naming another tenant changes nothing: /v1/usage has no such parameter.
    response = await get(s, "/v1/usage", s.a1, tenant_id=s.tenant_b, **RANGE)
    assert response.json()["tenant_id"] == s.tenant_a
    assert response.json()["totals"] == A_TOTALS
    response = await get(s, "/admin/usage", s.a1, tenant_id=s.tenant_b, **RANGE)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"


@pytest.mark.parametrize("path", ["/v1/usage", "/admin/usage"])
async def test_keys_are_required(service: Service, path: str) -> None:
    response = await service.client.get(path)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    response = await get(service, path, "lpx_t_not-a-key")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_scopes_and_admin_keys(service: Service) -> None:
    s = service
    response = await get(s, "/v1/usage", s.a_writer)
    assert response.status_code == 403
    assert response.json()["error"]["message"] == "This key lacks the 'inference' scope."
    for admin in (s.admin, ADMIN_KEY):
        response = await get(s, "/v1/usage", admin)
        assert response.status_code == 400
        assert "/admin/usage" in response.json()["error"]["message"]


async def test_admin_reads_any_tenant_or_all(service: Service) -> None:
    s = service
    response = await get(s, "/admin/usage", s.admin, tenant_id=s.tenant_b, **RANGE)
    assert response.status_code == 200, response.text
    assert response.json()["data"] == [row(s.tenant_b, **B_TOTALS)]
    response = await get(s, "/admin/usage", ADMIN_KEY, group_by="day", **RANGE)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tenant_id"] is None
    assert body["data"] == sorted([
        row(s.tenant_a, day="2026-03-01", **counts(2, 1, 1, 0, 30, 12, 2)),
        row(s.tenant_a, day="2026-03-02", **counts(2, 1, 0, 1, 70, 24, 12)),
        row(s.tenant_b, day="2026-03-01", **counts(1, 1, 0, 0, 1000, 100, 0)),
        row(s.tenant_b, day="2026-03-02", **counts(1, 0, 0, 1, 2000, 200, 0)),
    ], key=lambda r: (r["tenant_id"], r["day"]))
    assert body["totals"] == counts(6, 3, 1, 2, 3100, 336, 14)


async def test_admin_csv(service: Service) -> None:
    s = service
    response = await get(s, "/admin/usage", s.admin, tenant_id=s.tenant_a, group_by="key",
                         format="csv", **RANGE)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/csv; charset=utf-8"
    assert response.headers["content-disposition"] == (
        f'attachment; filename="usage-{s.tenant_a}-20260301-20260303.csv"')
    lines = list(csv.reader(io.StringIO(response.text)))
    assert lines[0] == [
        "tenant_id", "key_id", "key_name", "requests", "requests_ok", "requests_aborted",
        "requests_error", "prompt_tokens", "completion_tokens", "cached_tokens",
        "total_tokens", "cost", "currency",
    ]
    assert sorted(lines[1:-1]) == sorted([
        [s.tenant_a, s.key_a1, "prod", "3", "2", "1", "0", "70", "25", "10", "95", "", ""],
        # A name that a spreadsheet would run as a formula is quoted out.
        [s.tenant_a, s.key_a2, "'=cmd|calc", "1", "0", "0", "1", "30", "11", "4", "41", "", ""],
    ])
    assert lines[-1] == ["total", "", "", "4", "2", "1", "1", "100", "36", "14", "136", "", ""]

    response = await get(s, "/admin/usage", s.admin, group_by="day", format="csv", **RANGE)
    parsed = list(csv.DictReader(io.StringIO(response.text)))
    groups = sorted([
        (s.tenant_a, "2026-03-01", "42"), (s.tenant_a, "2026-03-02", "94"),
        (s.tenant_b, "2026-03-01", "1100"), (s.tenant_b, "2026-03-02", "2200"),
    ])
    assert [(r["tenant_id"], r["day"], r["total_tokens"]) for r in parsed] == [
        *groups, ("total", "", "3436")]
    assert 'filename="usage-all-20260301-20260303.csv"' in response.headers[
        "content-disposition"]


# ------------------------------------------------------------------ bad input


BAD_PARAMETERS: list[tuple[dict[str, str], str, str | None]] = [
    ({"start": "yesterday"}, "start", "Invalid value for 'start': expected an ISO 8601 date "
     "(2026-01-31), date-time (2026-01-31T12:00:00Z) or unix seconds, got 'yesterday'."),
    ({"start": "2026-03-01", "end": "2026-02-30"}, "end", None),
    ({"start": "99999999999999999999"}, "start", None),
    ({"start": "2026-03-02", "end": "2026-03-01"}, "end",
     "'end' (2026-03-01T00:00:00+00:00) must be after 'start' (2026-03-02T00:00:00+00:00)."),
    ({"start": "2026-03-01", "end": "2026-03-01"}, "end", None),
    ({"start": "2025-01-01", "end": "2026-03-01"}, "end",
     "The range from 'start' to 'end' may span at most 400 days; ask for a shorter one."),
    ({"group_by": "week"}, "group_by",
     "Invalid value for 'group_by': expected one of day, adapter, key, got 'week'."),
]


async def test_bad_parameters(service: Service) -> None:
    for path, key in (("/v1/usage", service.a1), ("/admin/usage", service.admin)):
        for params, param, message in BAD_PARAMETERS:
            response = await get(service, path, key, **params)
            assert response.status_code == 400, (path, params, response.text)
            error = response.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", param)
            if message is not None:
                assert error["message"] == message


async def test_bad_admin_parameters(service: Service) -> None:
    response = await get(service, "/admin/usage", service.admin, format="xml")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "format"
    response = await get(service, "/admin/usage", service.admin, tenant_id="ten_nobody")
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "No tenant with id 'ten_nobody'.", "type": "invalid_request_error",
        "param": "tenant_id", "code": "not_found"}

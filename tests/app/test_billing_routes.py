"""Billing over HTTP through the whole app, on SQLite and PostgreSQL: /admin/plans,
/admin/invoices (JSON, CSV, printable HTML, finalisation, late usage), tenants' plans,
and the cost column of usage reports."""

from __future__ import annotations

import asyncio
import csv
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.core.config import Settings
from app.db import session_scope
from app.main import create_app
from app.tables import InvoiceRecord, UsageRecord, UsageStatus, new_id
from tests.utils.fake_engine import FakeEngine, asgi_client
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer

ADMIN = bearer(ADMIN_KEY)
OCT_5 = datetime(2026, 10, 5, 12, tzinfo=UTC)
NOV_1 = datetime(2026, 11, 1, tzinfo=UTC)
OVERRIDDEN = "ad_override00001"
PLAN: dict[str, Any] = {
    "name": "pro",
    "currency": "USD",
    "prompt_per_mtok": "1.50",
    "completion_per_mtok": "6",
    "cached_prompt_per_mtok": "0.375",
    "adapter_month": "20.00",
    "monthly_minimum": "1.00",
    "adapter_overrides": {OVERRIDDEN: {
        "prompt_per_mtok": "0.10", "completion_per_mtok": "0.20",
        "cached_prompt_per_mtok": "0.05"}},
}


@dataclass
class Api:
    client: httpx.AsyncClient
    db: sessionmaker[Session]
    app: Any

    async def post(self, path: str, body: dict[str, Any], key: str = ADMIN_KEY
                   ) -> httpx.Response:
        return await self.client.post(path, json=body, headers=bearer(key))

    async def get(self, path: str, key: str = ADMIN_KEY, **params: Any) -> httpx.Response:
        return await self.client.get(path, params=params, headers=bearer(key))

    async def tenant(self, name: str, plan: str | None = "pro") -> str:
        response = await self.post("/admin/tenants", {"name": name, "plan": plan})
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    async def key(self, tenant_id: str) -> str:
        response = await self.post(f"/admin/tenants/{tenant_id}/keys", {"name": "k"})
        assert response.status_code == 201, response.text
        return str(response.json()["key"])

    def usage(self, tenant_id: str, at: datetime, *, adapter: str | None = None,
              key_id: str | None = None, prompt: int, completion: int, cached: int = 0) -> None:
        with session_scope(self.db) as session:
            session.add(UsageRecord(
                request_id=new_id("req"), tenant_id=tenant_id, key_id=key_id, model="m",
                adapter_id=adapter, adapter_version=None, prompt_tokens=prompt,
                completion_tokens=completion, cached_tokens=cached, ttft_ms=1.0,
                latency_ms=2.0, status=UsageStatus.OK.value, created_at=at,
            ))


@pytest.fixture
async def api(database_url: str, tmp_path: Path) -> AsyncIterator[Api]:
    settings = Settings(data_dir=tmp_path, database_url=database_url, admin_key=ADMIN_KEY,
                        secret_key=SECRET_KEY)
    app = create_app(FakeEngine(), settings)
    async with asgi_client(app) as client:
        yield Api(client, app.state.loraplex.db, app)


def decimal_sum(values: list[str]) -> Decimal:
    return sum((Decimal(v) for v in values), Decimal(0))


# ---------------------------------------------------------------------------------- plans


async def test_plans_create_list_get_and_validation(api: Api) -> None:
    response = await api.post("/admin/plans", PLAN)
    assert response.status_code == 201, response.text
    plan = response.json()
    assert plan["object"] == "plan" and isinstance(plan["created_at"], int)
    assert {k: plan[k] for k in PLAN if k != "adapter_overrides"} == {
        k: v for k, v in PLAN.items() if k != "adapter_overrides"}
    assert plan["adapter_overrides"] == PLAN["adapter_overrides"]
    assert (plan["volume_tiers"], plan["cached_prompt_per_mtok"]) == ([], "0.375")
    assert (await api.get("/admin/plans/pro")).json() == plan
    assert (await api.get("/admin/plans")).json() == {"object": "list", "data": [plan]}

    duplicate = await api.post("/admin/plans", PLAN)
    assert duplicate.status_code == 409
    assert duplicate.json()["error"]["code"] == "conflict"
    missing = await api.get("/admin/plans/gold")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")

    bad: list[tuple[dict[str, Any], str, str]] = [
        ({"prompt_per_mtok": 1.5}, "prompt_per_mtok", "not a float"),
        ({"prompt_per_mtok": "-1"}, "prompt_per_mtok", "must not be negative"),
        ({"monthly_minimum": "1.001"}, "monthly_minimum", "whole number of USD minor units"),
        ({"name": "has space"}, "name", "pattern"),
        ({"currency": "usd"}, "currency", "pattern"),
        ({"surprise": "1"}, "surprise", "Extra inputs"),
    ]
    for change, param, message in bad:
        response = await api.post("/admin/plans", {**PLAN, "name": "other", **change})
        assert response.status_code == 400, (change, response.text)
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"], error
    audit = (await api.get("/admin/audit", action="plan.create")).json()["data"]
    assert [(e["target_id"], e["actor"]) for e in audit] == [("pro", "bootstrap")]


async def test_a_tenants_plan_must_exist(api: Api) -> None:
    response = await api.post("/admin/tenants", {"name": "acme", "plan": "pro"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "plan"
    assert "No price plan named 'pro'" in response.json()["error"]["message"]
    tenant = await api.tenant("acme", plan=None)
    path = f"/admin/tenants/{tenant}"
    response = await api.client.patch(path, json={"plan": "pro"}, headers=ADMIN)
    assert (response.status_code, response.json()["error"]["param"]) == (400, "plan")
    assert (await api.post("/admin/plans", PLAN)).status_code == 201
    response = await api.client.patch(path, json={"plan": "pro"}, headers=ADMIN)
    assert (response.status_code, response.json()["plan"]) == (200, "pro")
    response = await api.client.patch(path, json={"plan": None}, headers=ADMIN)
    assert (response.status_code, response.json()["plan"]) == (200, None)


# ------------------------------------------------------------------------------- invoices


async def test_invoice_json_csv_html_finalize_and_late_usage(api: Api) -> None:
    assert (await api.post("/admin/plans", PLAN)).status_code == 201
    tenant = await api.tenant("acme")
    api.usage(tenant, OCT_5, prompt=1_234_567, completion=89_012, cached=34_567)
    api.usage(tenant, OCT_5 + timedelta(days=3), adapter=OVERRIDDEN, prompt=500_000,
              completion=250_000)
    created = await api.post("/admin/invoices", {"tenant_id": tenant, "period": "2026-10"})
    assert created.status_code == 200, created.text
    invoice = created.json()
    assert (invoice["object"], invoice["tenant_id"], invoice["period"], invoice["status"]) == (
        "invoice", tenant, "2026-10", "draft")
    assert invoice["id"].startswith("inv_") and invoice["currency"] == "USD"
    assert Decimal(invoice["total"]) == decimal_sum([line["amount"] for line in invoice["lines"]])
    # 1.2 Mtok uncached prompt at 1.50, 0.034567 cached at 0.375, 0.089012 completion at 6;
    # then the overridden adapter's 0.5 and 0.25 Mtok at 0.10 and 0.20.
    assert [line["amount"] for line in invoice["lines"]] == [
        "1.80", "0.01", "0.53", "0.05", "0.05"]
    assert invoice["total"] == "2.44"

    # Regenerating, even concurrently: the same invoice, one row.
    again = await api.post("/admin/invoices", {"tenant_id": tenant, "period": "2026-10"})
    assert again.content == created.content
    racing = await asyncio.gather(*(
        api.post("/admin/invoices", {"tenant_id": tenant, "period": "2026-11"})
        for _ in range(4)))
    assert all(r.status_code == 200 for r in racing), [r.text for r in racing]
    assert len({r.json()["id"] for r in racing}) == 1
    with session_scope(api.db) as session:
        counted = session.scalar(select(func.count()).select_from(InvoiceRecord))
    assert counted == 2
    listed = (await api.get("/admin/invoices", tenant_id=tenant)).json()["data"]
    assert [i["period"] for i in listed] == ["2026-11", "2026-10"]

    csv_response = await api.get(f"/admin/invoices/{invoice['id']}", format="csv")
    assert csv_response.status_code == 200
    assert csv_response.headers["content-type"] == "text/csv; charset=utf-8"
    assert csv_response.headers["content-disposition"] == (
        f'attachment; filename="invoice-{tenant}-2026-10.csv"')
    rows = list(csv.DictReader(io.StringIO(csv_response.text)))
    assert rows[-1]["kind"] == "total" and rows[-1]["amount"] == invoice["total"]
    assert decimal_sum([r["amount"] for r in rows[:-1]]) == Decimal(invoice["total"])
    html = await api.get(f"/admin/invoices/{invoice['id']}", format="html")
    assert html.headers["content-type"] == "text/html; charset=utf-8"
    assert f'id="invoice-total">{invoice["total"]} USD<' in html.text and "DRAFT" in html.text

    final = await api.client.post(f"/admin/invoices/{invoice['id']}/finalize", headers=ADMIN)
    assert final.status_code == 200, final.text
    assert final.json()["status"] == "final" and final.json()["finalized_at"] is not None
    frozen = (await api.get(f"/admin/invoices/{invoice['id']}")).content

    # Late usage for October: October stays byte for byte, November bills it.
    api.usage(tenant, OCT_5 + timedelta(days=20), prompt=2_000_000, completion=0)
    assert (await api.get(f"/admin/invoices/{invoice['id']}")).content == frozen
    again = await api.post("/admin/invoices", {"tenant_id": tenant, "period": "2026-10"})
    assert again.content == frozen
    november = (await api.post(
        "/admin/invoices", {"tenant_id": tenant, "period": "2026-11"})).json()
    late = [line for line in november["lines"] if line["kind"] == "adjustment"]
    assert [(line["incurred_in"], line["quantity"], line["amount"]) for line in late] == [
        ("2026-10", "2", "3.00")]
    assert (november["adjustments"], november["minimum_top_up"]) == ("3.00", "1.00")
    assert november["total"] == "4.00"
    actions = [e["action"] for e in (await api.get(
        "/admin/audit", target_id=invoice["id"])).json()["data"]]
    assert actions == ["invoice.finalize", "invoice.create"]


async def test_invoice_errors_and_tenant_keys(api: Api) -> None:
    assert (await api.post("/admin/plans", PLAN)).status_code == 201
    planless = await api.tenant("planless", plan=None)
    tenant = await api.tenant("acme")
    tenant_key = await api.key(tenant)
    cases = [
        ({"tenant_id": "ten_nobody", "period": "2026-10"}, 404, None),
        ({"tenant_id": tenant, "period": "October"}, 400, "period"),
        ({"tenant_id": tenant}, 400, "period"),
        ({"tenant_id": planless, "period": "2026-10"}, 400, "tenant_id"),
    ]
    for body, status, param in cases:
        response = await api.post("/admin/invoices", body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["param"] == param
    assert "has no price plan" in (await api.post(
        "/admin/invoices", {"tenant_id": planless, "period": "2026-10"})).json()["error"][
        "message"]
    invoice = (await api.post("/admin/invoices", {"tenant_id": tenant, "period": "2026-10"}
                              )).json()
    assert (await api.get(f"/admin/invoices/{invoice['id']}", format="xml")).status_code == 400
    assert (await api.get("/admin/invoices/inv_nobody")).status_code == 404
    assert (await api.client.post("/admin/invoices/inv_nobody/finalize",
                                  headers=ADMIN)).status_code == 404
    assert (await api.get("/admin/invoices", tenant_id="ten_nobody")).status_code == 404

    for method, path in [
        ("GET", "/admin/plans"), ("GET", "/admin/plans/pro"), ("POST", "/admin/plans"),
        ("GET", "/admin/invoices"), ("POST", "/admin/invoices"),
        ("GET", f"/admin/invoices/{invoice['id']}"),
        ("POST", f"/admin/invoices/{invoice['id']}/finalize"),
    ]:
        response = await api.client.request(
            method, path, headers=bearer(tenant_key),
            json={"tenant_id": tenant, "period": "2026-10"} if method == "POST" else None)
        assert response.status_code == 403, (method, path, response.text)
        assert response.json()["error"]["code"] == "permission_denied"
        assert (await api.client.request(method, path)).status_code == 401


# ------------------------------------------------------------------------- usage reports


async def test_usage_reports_carry_cost_when_the_tenant_has_a_plan(api: Api) -> None:
    assert (await api.post("/admin/plans", PLAN)).status_code == 201
    tenant = await api.tenant("acme")
    planless = await api.tenant("globex", plan=None)
    # One day, two adapters (two prices): each (adapter, kind) is a rounded line.
    api.usage(tenant, OCT_5, prompt=1_000_003, completion=1_001, cached=3)
    api.usage(tenant, OCT_5, adapter=OVERRIDDEN, prompt=333_333, completion=0)
    api.usage(planless, OCT_5, prompt=5, completion=5)
    span = {"start": "2026-10-01", "end": "2026-11-01"}
    # 1.0 Mtok at 1.50 = 1.50; 3 cached: 0.00; 1001 completion at 6: 0.006006 -> 0.01;
    # 0.333333 Mtok at 0.10: 0.0333333 -> 0.03.
    expected = {None: "1.51", OVERRIDDEN: "0.03"}
    by_adapter = (await api.get("/admin/usage", tenant_id=tenant, group_by="adapter",
                                **span)).json()
    assert {r["adapter_id"]: r["cost"] for r in by_adapter["data"]} == expected
    assert {r["currency"] for r in by_adapter["data"]} == {"USD"}
    assert (by_adapter["totals"]["cost"], by_adapter["totals"]["currency"]) == ("1.54", "USD")
    for group_by in ("day", "key", None):
        params = span if group_by is None else {**span, "group_by": group_by}
        report = (await api.get("/admin/usage", tenant_id=tenant, **params)).json()
        assert [r["cost"] for r in report["data"]] == ["1.54"], group_by
    everyone = (await api.get("/admin/usage", group_by="day", **span)).json()
    assert {r["tenant_id"]: (r["cost"], r["currency"]) for r in everyone["data"]} == {
        tenant: ("1.54", "USD"), planless: (None, None)}
    assert everyone["totals"]["cost"] is None  # one tenant has no plan
    csv_text = (await api.get("/admin/usage", tenant_id=tenant, group_by="adapter",
                              format="csv", **span)).text
    rows = list(csv.DictReader(io.StringIO(csv_text)))
    assert [(r["cost"], r["currency"]) for r in rows] == [
        ("1.51", "USD"), ("0.03", "USD"), ("1.54", "USD")]
    # A month without usage costs zero, not nothing.
    empty = (await api.get("/admin/usage", tenant_id=tenant, start="2026-01-01",
                           end="2026-02-01")).json()
    assert (empty["totals"]["cost"], empty["totals"]["currency"]) == ("0.00", "USD")


async def test_own_usage_report_costs_real_requests(api: Api) -> None:
    plan = {**PLAN, "prompt_per_mtok": "1000000", "completion_per_mtok": "2000000"}
    assert (await api.post("/admin/plans", plan)).status_code == 201
    tenant = await api.tenant("acme")
    key = await api.key(tenant)
    response = await api.post(
        "/v1/completions", {"model": "fake-model", "prompt": "hello", "max_tokens": 3}, key)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert await asyncio.to_thread(api.app.state.loraplex.usage.flush, timeout_s=30)
    report = (await api.get("/v1/usage", key, group_by="day")).json()
    # One token costs 1 (prompt) or 2 (completion).
    cost = f"{usage['prompt_tokens'] + 2 * usage['completion_tokens']}.00"
    assert [(r["cost"], r["currency"]) for r in report["data"]] == [(cost, "USD")]
    assert report["totals"]["cost"] == cost

"""The overview: the last two weeks' requests and tokens, and what the engine holds."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, time, timedelta

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from admin_ui.charts import bar_chart, days
from admin_ui.deps import AuthedDep
from admin_ui.web import PREFIX, render
from app import tenants as crud
from app.api.deps import SessionDep
from app.api.routes.admin_engine import engine_view
from app.api.state import AppStateDep
from app.metering.reports import usage_report
from app.tables import utcnow

router = APIRouter()

OVERVIEW_DAYS = 14


@router.get(PREFIX, include_in_schema=False)
def root() -> RedirectResponse:
    return RedirectResponse(PREFIX + "/", status_code=307)


@router.get(PREFIX + "/", response_class=HTMLResponse)
def overview(
    request: Request, authed: AuthedDep, session: SessionDep, state: AppStateDep
) -> HTMLResponse:
    today = utcnow().date()
    first = today - timedelta(days=OVERVIEW_DAYS - 1)
    rows = usage_report(
        session, tenant_id=None,
        start=datetime.combine(first, time(), UTC),
        end=datetime.combine(today + timedelta(days=1), time(), UTC),
        group_by="day",
    )
    requests: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    for row in rows:
        assert row.day is not None, "grouped by day"
        requests[row.day.isoformat()] += row.requests
        tokens[row.day.isoformat()] += row.total_tokens
    labels = [d.isoformat() for d in days(first, today + timedelta(days=1))]
    charts = [
        bar_chart("Requests per day (UTC)", "requests", [(d, requests[d]) for d in labels]),
        bar_chart("Tokens per day (UTC)", "tokens", [(d, tokens[d]) for d in labels]),
    ]
    engine = engine_view(state=state, admin=authed.principal)
    return render(request, "overview.html", {
        "authed": authed,
        "active": "overview",
        "title": "Overview",
        "charts": charts,
        "engine": engine,
        "num_tenants": len(crud.list_tenants(session)),
        "num_adapters": len(state.directory.ready_versions()),
        "days": OVERVIEW_DAYS,
    })

"""Usage: a tenant (or all), a date range, grouped by day, adapter or key, as a chart, a
table and a CSV download, all from the admin API's report (GET /admin/usage)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import date, timedelta
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from admin_ui.charts import BarChart, bar_chart, days
from admin_ui.deps import Authed, AuthedDep
from admin_ui.web import PREFIX, render
from app import tenants as crud
from app.api.deps import SessionDep
from app.api.errors import APIError, service_error
from app.api.routes.usage import admin_usage
from app.api.schemas.usage import UsageReport
from app.core.errors import ServiceError
from app.metering.reports import GROUP_BY_VALUES, UsageRow
from app.tables import utcnow

router = APIRouter()

# Days are filled in (zero bars) up to this span; longer ranges show only days with use.
MAX_FILLED_DAYS = 92


@dataclass(frozen=True, slots=True)
class Query:
    """The page's query: dates as the form has them, `end` inclusive."""

    tenant_id: str
    start: str
    end: str
    group_by: str

    @classmethod
    def of(cls, tenant_id: str | None, start: str | None, end: str | None,
           group_by: str | None) -> Query:
        today = utcnow().date()
        return cls(
            tenant_id=tenant_id or "",
            start=start or today.replace(day=1).isoformat(),
            end=end or today.isoformat(),
            group_by=group_by or "day",
        )

    def api_params(self) -> dict[str, str | None]:
        """For GET /admin/usage, whose `end` is exclusive."""
        try:
            end = (date.fromisoformat(self.end) + timedelta(days=1)).isoformat()
        except ValueError:
            end = self.end  # the report refuses it with a clear message
        return {"tenant_id": self.tenant_id or None, "start": self.start, "end": end,
                "group_by": self.group_by}

    def url(self, path: str) -> str:
        pairs = {"tenant_id": self.tenant_id, "start": self.start, "end": self.end,
                 "group_by": self.group_by}
        return f"{path}?{urlencode(pairs)}"


def _label(row: UsageRow, group_by: str, names: dict[str, str], many_tenants: bool) -> str:
    if group_by == "day":
        label = row.day.isoformat() if row.day is not None else "-"
    elif group_by == "adapter":
        label = row.adapter_name or ("base model" if row.adapter_id is None else row.adapter_id)
    else:
        label = row.key_name or row.key_id or "no key (admin)"
    if many_tenants and group_by != "day":
        owner = names.get(row.tenant_id or "", row.tenant_id or "admin")
        return f"{owner} / {label}"
    return label


def _charts(report: UsageReport, query: Query, names: dict[str, str]) -> list[BarChart]:
    many = not query.tenant_id
    requests: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    for row in report.data:
        label = _label(row, query.group_by, names, many)
        requests[label] += row.requests
        tokens[label] += row.total_tokens
    labels = list(requests)
    if query.group_by == "day":
        span = days(report.start.date(), report.end.date())
        labels = [d.isoformat() for d in span] if len(span) <= MAX_FILLED_DAYS else sorted(labels)
    per = {"day": "per day (UTC)", "adapter": "per adapter", "key": "per key"}[query.group_by]
    return [
        bar_chart(f"Requests {per}", "requests", [(x, requests[x]) for x in labels]),
        bar_chart(f"Tokens {per}", "tokens", [(x, tokens[x]) for x in labels]),
    ]


@router.get(PREFIX + "/usage", response_class=HTMLResponse)
def usage_page(
    request: Request, authed: AuthedDep, session: SessionDep,
    tenant_id: str | None = None, start: str | None = None, end: str | None = None,
    group_by: str | None = None,
) -> HTMLResponse:
    query = Query.of(tenant_id, start, end, group_by)
    tenants = crud.list_tenants(session, include_deleted=True)
    names = {t.id: t.name for t in tenants}
    report: UsageReport | None = None
    error: APIError | None = None
    try:
        result = admin_usage(authed.principal, session, **query.api_params(), format_=None)
        assert isinstance(result, UsageReport), "JSON was asked for"
        report = result
    except APIError as exc:
        error = exc
    except ServiceError as exc:
        error = service_error(exc)
    return _render(request, authed, query, tenants=[(t.id, t.name) for t in tenants],
                   names=names, report=report, error=error)


def _render(request: Request, authed: Authed, query: Query, *, tenants: list[tuple[str, str]],
            names: dict[str, str], report: UsageReport | None, error: APIError | None
            ) -> HTMLResponse:
    rows = [] if report is None else [
        (names.get(r.tenant_id or "", r.tenant_id or "admin"),
         _label(r, query.group_by, names, False), r)
        for r in report.data
    ]
    return render(request, "usage.html", {
        "authed": authed, "active": "usage", "title": "Usage",
        "query": query, "tenants": tenants, "group_bys": [(g, g) for g in GROUP_BY_VALUES],
        "report": report, "rows": rows,
        "charts": [] if report is None else _charts(report, query, names),
        "csv_url": query.url(PREFIX + "/usage.csv"),
        "error": None if error is None else error.message,
    }, status_code=200 if error is None else error.status_code)


@router.get(PREFIX + "/usage.csv")
def usage_csv(
    authed: AuthedDep, session: SessionDep, tenant_id: str | None = None,
    start: str | None = None, end: str | None = None, group_by: str | None = None,
) -> Response:
    """The admin API's CSV (header, one row per group, a total row) for the page's query."""
    query = Query.of(tenant_id, start, end, group_by)
    result = admin_usage(authed.principal, session, **query.api_params(), format_="csv")
    assert isinstance(result, Response), "CSV was asked for"
    return result

"""Usage reports: GET /v1/usage (the caller's own tenant) and GET /admin/usage (any
tenant, JSON or CSV), with each row's list-price cost when the tenant has a price plan
(app/metering/reports.py says what that cost includes).

Times (`start` inclusive, `end` exclusive) are ISO 8601 dates or date-times (UTC when
no offset is given) or unix seconds; both omitted: the current calendar month (UTC).
"""

from __future__ import annotations

import csv
import io
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Response
from sqlalchemy.orm import Session

from app.api.deps import AdminPrincipal, InferencePrincipal, SessionDep
from app.api.errors import APIError, invalid_request
from app.api.openapi import error_responses
from app.api.schemas.usage import UsageReport
from app.billing.records import tenant_plans
from app.metering.reports import (
    GROUP_BY_VALUES,
    GroupBy,
    UsageCounts,
    usage_report,
    usage_totals,
)
from app.tables import Tenant, utcnow

router = APIRouter(tags=["usage"])

MAX_SPAN = timedelta(days=400)
_UNIX_SECONDS = re.compile(r"-?\d+(\.\d+)?")
# An unencoded '+' of an offset arrives as a space ("...T10:00:00 02:00").
_SPACED_OFFSET = re.compile(r"(T[\d:.]+) (\d{2}(:?\d{2})?)$")
_CSV_GROUP_COLUMNS: dict[GroupBy | None, tuple[str, ...]] = {
    None: (),
    "day": ("day",),
    "adapter": ("adapter_id", "adapter_name"),
    "key": ("key_id", "key_name"),
}
_CSV_COUNT_COLUMNS = tuple(UsageCounts.model_fields)
# Empty cells for a tenant without a price plan.
_CSV_COST_COLUMNS = ("cost", "currency")
# Free-text cells a spreadsheet could take for a formula (CSV injection).
_CSV_TEXT_COLUMNS = frozenset({"adapter_name", "key_name"})
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


@router.get("/v1/usage", response_model=UsageReport, responses=error_responses(400))
def own_usage(
    principal: InferencePrincipal,
    session: SessionDep,
    start: str | None = None,
    end: str | None = None,
    group_by: str | None = None,
) -> UsageReport:
    """The caller's tenant's usage."""
    if principal.tenant_id is None:
        raise invalid_request(
            "This key belongs to no tenant: /v1/usage reports the caller's own tenant. "
            "Admins read any tenant's usage at /admin/usage?tenant_id=..."
        )
    return _report(session, principal.tenant_id, start, end, group_by)


@router.get(
    "/admin/usage",
    response_model=UsageReport,
    responses={
        200: {"content": {"text/csv": {"schema": {"type": "string"}}},
              "description": "JSON, or CSV"},
        **error_responses(400, 404),
    },
)
def admin_usage(
    principal: AdminPrincipal,
    session: SessionDep,
    tenant_id: str | None = None,
    start: str | None = None,
    end: str | None = None,
    group_by: str | None = None,
    format_: Annotated[str | None, Query(alias="format")] = None,
) -> UsageReport | Response:
    """One tenant's usage, or every tenant's (each its own rows) without `tenant_id`.
    CSV: a header row, one row per group, then a `total` row."""
    if format_ not in (None, "json", "csv"):
        raise invalid_request(
            f"Invalid value for 'format': expected json or csv, got '{format_}'.",
            param="format",
        )
    if tenant_id is not None and session.get(Tenant, tenant_id) is None:
        raise APIError(404, f"No tenant with id '{tenant_id}'.", param="tenant_id",
                       code="not_found")
    report = _report(session, tenant_id, start, end, group_by)
    if format_ == "csv":
        return _csv_response(report)
    return report


# ----------------------------------------------------------------------------- helpers


def _report(
    session: Session,
    tenant_id: str | None,
    start: str | None,
    end: str | None,
    group_by: str | None,
) -> UsageReport:
    grouping = _parse_group_by(group_by)
    start_at, end_at = time_range(start, end, now=utcnow())
    rows = usage_report(
        session, tenant_id=tenant_id, start=start_at, end=end_at, group_by=grouping
    )
    plan = None if tenant_id is None else tenant_plans(session, [tenant_id]).get(tenant_id)
    return UsageReport(
        tenant_id=tenant_id,
        start=start_at,
        end=end_at,
        group_by=grouping,
        data=rows,
        totals=usage_totals(rows, currency=None if plan is None else plan.currency),
    )


def _parse_group_by(value: str | None) -> GroupBy | None:
    if value is None or value == "":
        return None
    for known in GROUP_BY_VALUES:
        if value == known:
            return known
    raise invalid_request(
        f"Invalid value for 'group_by': expected one of {', '.join(GROUP_BY_VALUES)}, "
        f"got '{value}'.",
        param="group_by",
    )


def parse_time(value: str, param: str) -> datetime:
    """An ISO 8601 date or date-time (naive = UTC) or unix seconds, as aware UTC."""
    text = value.strip()
    try:
        if _UNIX_SECONDS.fullmatch(text):
            return datetime.fromtimestamp(float(text), UTC)
        parsed = datetime.fromisoformat(_SPACED_OFFSET.sub(r"\1+\2", text))
    except (ValueError, OverflowError, OSError):
        raise invalid_request(
            f"Invalid value for '{param}': expected an ISO 8601 date (2026-01-31), "
            f"date-time (2026-01-31T12:00:00Z) or unix seconds, got '{value}'.",
            param=param,
        ) from None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)


def _month_start(at: datetime) -> datetime:
    return at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def _next_month(month_start: datetime) -> datetime:
    return (month_start + timedelta(days=32)).replace(day=1)


def time_range(start: str | None, end: str | None, *, now: datetime) -> tuple[datetime, datetime]:
    """[start, end) from the query; defaults: `end` the end of the current month, `start`
    the beginning of the month `end` falls in."""
    end_at = parse_time(end, "end") if end else _next_month(_month_start(now))
    if start:
        start_at = parse_time(start, "start")
    else:
        start_at = _month_start(end_at - timedelta(microseconds=1))
    if start_at >= end_at:
        raise invalid_request(
            f"'end' ({end_at.isoformat()}) must be after 'start' ({start_at.isoformat()}).",
            param="end",
        )
    if end_at - start_at > MAX_SPAN:
        raise invalid_request(
            f"The range from 'start' to 'end' may span at most {MAX_SPAN.days} days; "
            "ask for a shorter one.",
            param="end",
        )
    return start_at, end_at


def _csv_cell(column: str, value: object) -> object:
    if column in _CSV_TEXT_COLUMNS and isinstance(value, str) and value.startswith(
        _FORMULA_START
    ):
        return "'" + value
    return value


def _csv_response(report: UsageReport) -> Response:
    group_columns = _CSV_GROUP_COLUMNS[report.group_by]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(("tenant_id", *group_columns, *_CSV_COUNT_COLUMNS, *_CSV_COST_COLUMNS))
    for row in report.data:
        values = row.model_dump(mode="json")
        writer.writerow([
            values["tenant_id"],
            *(_csv_cell(c, values[c]) for c in group_columns),
            *(values[c] for c in _CSV_COUNT_COLUMNS),
            *(values[c] for c in _CSV_COST_COLUMNS),
        ])
    totals = report.totals.model_dump(mode="json")
    writer.writerow(["total", *("" for _ in group_columns),
                     *(totals[c] for c in _CSV_COUNT_COLUMNS),
                     *(totals[c] for c in _CSV_COST_COLUMNS)])
    who = re.sub(r"[^A-Za-z0-9_.-]", "_", report.tenant_id or "all")
    filename = f"usage-{who}-{report.start:%Y%m%d}-{report.end:%Y%m%d}.csv"
    return Response(
        buffer.getvalue(),
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )

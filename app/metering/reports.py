"""Usage reports: sums over usage_records per tenant and per day, adapter or key."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any, Literal

from pydantic import BaseModel
from sqlalchemy import ColumnElement, String, case, func, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import QueryableAttribute, Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from app.models import Adapter, ApiKey, UsageRecord, UsageStatus

_Column = ColumnElement[Any] | QueryableAttribute[Any]
GroupBy = Literal["day", "adapter", "key"]
GROUP_BY_VALUES: tuple[GroupBy, ...] = ("day", "adapter", "key")


class UsageCounts(BaseModel):
    requests: int = 0
    requests_ok: int = 0
    requests_aborted: int = 0
    requests_error: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # part of prompt_tokens
    total_tokens: int = 0  # prompt + completion

    def add(self, other: UsageCounts) -> None:
        for name in UsageCounts.model_fields:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class UsageRow(UsageCounts):
    """One group: a tenant's usage, on one day / of one adapter / through one key
    (the fields of the other groupings are None)."""

    tenant_id: str | None  # None: served without keys (--no-auth)
    day: date | None = None  # UTC
    adapter_id: str | None = None  # None with group_by=adapter: the base model
    adapter_name: str | None = None
    key_id: str | None = None
    key_name: str | None = None


class utc_day(FunctionElement[str]):
    """The UTC calendar date of a timestamp as 'YYYY-MM-DD', on SQLite and PostgreSQL.

    NOTE: no bound parameters inside, so that the same text in SELECT and GROUP BY is
    the same expression to PostgreSQL.
    """

    type = String()
    inherit_cache = True
    name = "utc_day"


@compiles(utc_day, "sqlite")
def _utc_day_sqlite(element: utc_day, compiler: SQLCompiler, **kw: Any) -> str:
    # SQLite keeps naive UTC text ('YYYY-MM-DD HH:MM:SS.ffffff'): its date part.
    return f"date({compiler.process(element.clauses, **kw)})"


@compiles(utc_day, "postgresql")
def _utc_day_postgresql(element: utc_day, compiler: SQLCompiler, **kw: Any) -> str:
    # timestamptz -> UTC wall time first: date() alone would use the session's time zone.
    column = compiler.process(element.clauses, **kw)
    return f"to_char(({column}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


def _count_status(status: UsageStatus) -> ColumnElement[Any]:
    return func.sum(case((UsageRecord.status == status.value, 1), else_=0))


def usage_report(
    session: Session,
    *,
    tenant_id: str | None,
    start: datetime,
    end: datetime,
    group_by: GroupBy | None,
) -> list[UsageRow]:
    """Usage from `start` (inclusive) to `end` (exclusive), per tenant and per
    `group_by`; `tenant_id=None`: every tenant (each its own rows). Ordered by tenant,
    then day / adapter id / key id (None first)."""
    assert start.tzinfo is not None and end.tzinfo is not None, "aware datetimes"
    r = UsageRecord
    groups: list[_Column] = [r.tenant_id]
    labels: list[_Column] = []
    joins: list[tuple[Any, Any]] = []
    if group_by == "day":
        day = utc_day(r.created_at)
        groups.append(day)
        labels.append(day.label("day"))
    elif group_by == "adapter":
        groups.append(r.adapter_id)
        labels += [r.adapter_id, func.max(Adapter.name).label("adapter_name")]
        joins.append((Adapter, Adapter.id == r.adapter_id))
    elif group_by == "key":
        groups.append(r.key_id)
        labels += [r.key_id, func.max(ApiKey.name).label("key_name")]
        joins.append((ApiKey, ApiKey.id == r.key_id))
    else:
        assert group_by is None, group_by
    query = select(
        r.tenant_id,
        *labels,
        func.count().label("requests"),
        _count_status(UsageStatus.OK).label("requests_ok"),
        _count_status(UsageStatus.ABORTED).label("requests_aborted"),
        _count_status(UsageStatus.ERROR).label("requests_error"),
        func.sum(r.prompt_tokens).label("prompt_tokens"),
        func.sum(r.completion_tokens).label("completion_tokens"),
        func.sum(r.cached_tokens).label("cached_tokens"),
    ).select_from(r)
    for target, on in joins:
        query = query.outerjoin(target, on)
    query = query.where(r.created_at >= start, r.created_at < end).group_by(*groups)
    if tenant_id is not None:
        query = query.where(r.tenant_id == tenant_id)
    rows: list[UsageRow] = []
    for row in session.execute(query).mappings():
        values = dict(row)
        for name in ("requests_ok", "requests_aborted", "requests_error", "prompt_tokens",
                     "completion_tokens", "cached_tokens"):
            values[name] = int(values[name] or 0)
        if "day" in values:
            values["day"] = date.fromisoformat(values["day"])
        values["total_tokens"] = values["prompt_tokens"] + values["completion_tokens"]
        rows.append(UsageRow.model_validate(values))
    # Sorted here: NULLs order differently on SQLite and PostgreSQL.
    rows.sort(key=_sort_key)
    return rows


def _sort_key(row: UsageRow) -> tuple[Any, ...]:
    def nullable(value: Any) -> tuple[bool, Any]:
        return (value is not None, value if value is not None else "")

    return (
        nullable(row.tenant_id), nullable(row.day), nullable(row.adapter_id),
        nullable(row.key_id),
    )


def usage_totals(rows: list[UsageRow]) -> UsageCounts:
    totals = UsageCounts()
    for row in rows:
        totals.add(row)
    return totals


def tokens_since(session: Session, start: datetime) -> dict[str, int]:
    """Tokens (prompt + completion) each tenant used since `start`, from the usage rows."""
    total = func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens)
    rows = session.execute(
        select(UsageRecord.tenant_id, total)
        .where(UsageRecord.created_at >= start, UsageRecord.tenant_id.is_not(None))
        .group_by(UsageRecord.tenant_id)
    )
    return {tenant_id: int(tokens or 0) for tenant_id, tokens in rows if tenant_id}

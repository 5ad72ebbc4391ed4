"""Usage reports: sums over usage_records per tenant and per day, adapter or key, with
what the tokens cost under the tenant's price plan.

Cost of a row (``cost``, in the plan's ``currency``; None for a tenant without a plan):
the row's tokens of each kind and adapter times the plan's base price of that kind (or
the adapter's override price), each such line rounded with the invoices' one rule
(half-to-even to the currency's minor unit), then summed. It is list price only: monthly
minimums, volume tiers, adapter hosting and late-usage adjustments appear only on
invoices (app/billing/service.py), so a month's report cost need not equal its invoice.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel
from sqlalchemy import ColumnElement, case, func, select
from sqlalchemy.orm import QueryableAttribute, Session

from app.billing.invoice import round_amount, token_amount
from app.billing.plans import TOKEN_KINDS, PricePlan
from app.billing.records import tenant_plans
from app.sql_time import utc_day
from app.tables import Adapter, ApiKey, UsageRecord, UsageStatus

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
    cost: Decimal | None = None  # list price under the tenant's plan; None: no plan
    currency: str | None = None


class UsageTotals(UsageCounts):
    """The sum of a report's rows; ``cost`` only when every row is priced in one currency."""

    cost: Decimal | None = None
    currency: str | None = None


def _count_status(status: UsageStatus) -> ColumnElement[Any]:
    return func.sum(case((UsageRecord.status == status.value, 1), else_=0))


def _grouping(
    group_by: GroupBy | None,
) -> tuple[list[_Column], list[_Column], list[tuple[Any, Any]]]:
    """(GROUP BY columns, extra SELECT columns, outer joins) of a grouping."""
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
    return groups, labels, joins


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
    then day / adapter id / key id (None first). Rows of tenants with a plan carry cost."""
    assert start.tzinfo is not None and end.tzinfo is not None, "aware datetimes"
    r = UsageRecord
    groups, labels, joins = _grouping(group_by)
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
    in_range = [r.created_at >= start, r.created_at < end]
    if tenant_id is not None:
        in_range.append(r.tenant_id == tenant_id)
    query = query.where(*in_range).group_by(*groups)
    costs = _costs(session, groups, in_range)
    rows: list[UsageRow] = []
    for row in session.execute(query).mappings():
        values = dict(row)
        for name in ("requests_ok", "requests_aborted", "requests_error", "prompt_tokens",
                     "completion_tokens", "cached_tokens"):
            values[name] = int(values[name] or 0)
        group_key = tuple(values.get(name) for name in _group_names(group_by))
        priced = costs.get((values["tenant_id"], *group_key))
        if priced is not None:
            values["cost"], values["currency"] = priced
        if "day" in values:
            values["day"] = date.fromisoformat(values["day"])
        values["total_tokens"] = values["prompt_tokens"] + values["completion_tokens"]
        rows.append(UsageRow.model_validate(values))
    # Sorted here: NULLs order differently on SQLite and PostgreSQL.
    rows.sort(key=_sort_key)
    return rows


def _group_names(group_by: GroupBy | None) -> tuple[str, ...]:
    return {None: (), "day": ("day",), "adapter": ("adapter_id",), "key": ("key_id",)}[
        group_by
    ]


def _costs(
    session: Session, groups: list[_Column], where: list[ColumnElement[bool]]
) -> dict[tuple[Any, ...], tuple[Decimal, str]]:
    """(tenant id, group value) -> (cost, currency) for the groups of tenants with a plan.

    The groups are split by adapter (the price depends on it) and by token kind: each
    (group, adapter, kind) is one line, rounded as on an invoice.
    """
    r = UsageRecord
    tenants = session.scalars(select(r.tenant_id).where(*where).distinct())
    plans = tenant_plans(session, (t for t in tenants if t is not None))
    if not plans:
        return {}
    grouped_by_adapter = any(column is r.adapter_id for column in groups)
    by_adapter = groups if grouped_by_adapter else [*groups, r.adapter_id]
    query = (
        select(
            *by_adapter,
            func.sum(r.prompt_tokens),
            func.sum(r.completion_tokens),
            func.sum(r.cached_tokens),
        )
        .where(*where, r.tenant_id.in_(sorted(plans)))
        .group_by(*by_adapter)
    )
    width = len(by_adapter)
    costs: dict[tuple[Any, ...], Decimal] = defaultdict(Decimal)
    for values in session.execute(query):
        key, adapter_id = tuple(values[: len(groups)]), values[width - 1]
        prompt, completion, cached = (int(v or 0) for v in values[width:])
        plan = plans[key[0]]
        costs[key] += list_price(plan, adapter_id, prompt - cached, cached, completion)
    return {
        key: (round_amount(cost, plans[key[0]].currency), plans[key[0]].currency)
        for key, cost in costs.items()
    }


def list_price(
    plan: PricePlan, adapter_id: str | None, prompt: int, cached_prompt: int, completion: int
) -> Decimal:
    """Uncached prompt, cached prompt and completion tokens at the plan's base (or the
    adapter's override) prices: one rounded amount per kind, summed."""
    prices = plan.adapter_overrides.get(adapter_id or "", plan.base_prices)
    tokens = dict(zip(TOKEN_KINDS, (prompt, cached_prompt, completion), strict=True))
    total = Decimal(0)
    for kind in TOKEN_KINDS:
        if tokens[kind]:
            total += token_amount(tokens[kind], prices.per_mtok(kind), plan.currency)
    return total


def _sort_key(row: UsageRow) -> tuple[Any, ...]:
    def nullable(value: Any) -> tuple[bool, Any]:
        return (value is not None, value if value is not None else "")

    return (
        nullable(row.tenant_id), nullable(row.day), nullable(row.adapter_id),
        nullable(row.key_id),
    )


def usage_totals(rows: list[UsageRow], *, currency: str | None = None) -> UsageTotals:
    """Sums of `rows`; `currency`: the one tenant's plan currency (an empty report of a
    tenant with a plan then costs zero rather than nothing)."""
    totals = UsageTotals()
    for row in rows:
        totals.add(row)
    currencies = {row.currency for row in rows}
    if currency is not None:
        currencies.add(currency)
    if len(currencies) == 1 and None not in currencies:
        (totals.currency,) = currencies
        cost = Decimal(0)
        for row in rows:
            assert row.cost is not None
            cost += row.cost
        assert totals.currency is not None
        totals.cost = round_amount(cost, totals.currency)
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

"""What an invoice is computed from, read from the database: a tenant's usage rows summed
per month and adapter, the adapters it hosted, and which usage a period bills.

Which rows a period bills (see the rules in app/billing/service.py): rows no final
invoice has billed (``invoice_id`` NULL) that happened in the period itself, or in a
finalised month of the unbroken run of finalised months just before it (late usage:
the period is the first open month after theirs).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from sqlalchemy import ColumnElement, and_, func, select, update
from sqlalchemy.orm import Session

from app.billing.invoice import BillableUsage, HostedAdapter
from app.billing.periods import month_start, next_period, previous_period
from app.billing.plans import PricePlan
from app.sql_time import utc_month
from app.tables import (
    Adapter,
    AdapterStatus,
    AdapterVersion,
    InvoiceRecord,
    PlanRecord,
    Tenant,
    UsageRecord,
)

# Adapter-months are rounded to this quantum (a millionth of a month is ~2.7 s).
MONTHS_QUANTUM = Decimal("0.000001")


@dataclass(frozen=True, slots=True)
class BillingWindow:
    """The usage a period bills: unbilled rows with ``start <= created_at < end``."""

    period: str
    start: datetime  # the start of the earliest month whose late usage lands here
    end: datetime  # the end of the period


def finalized_periods(session: Session, tenant_id: str) -> set[str]:
    query = select(InvoiceRecord.period).where(
        InvoiceRecord.tenant_id == tenant_id, InvoiceRecord.status == "final"
    )
    return set(session.scalars(query))


def billing_window(period: str, finalized: set[str]) -> BillingWindow:
    """The window of an open ``period``, given the tenant's finalised periods."""
    assert period not in finalized, "a final invoice is never recomputed"
    earliest = period
    while previous_period(earliest) in finalized:
        earliest = previous_period(earliest)
    return BillingWindow(
        period=period, start=month_start(earliest), end=month_start(next_period(period))
    )


def _unbilled(tenant_id: str, window: BillingWindow) -> ColumnElement[bool]:
    r = UsageRecord
    return and_(
        r.tenant_id == tenant_id,
        r.invoice_id.is_(None),
        r.created_at >= window.start,
        r.created_at < window.end,
    )


def _billable(
    session: Session, where: ColumnElement[bool], period: str
) -> list[BillableUsage]:
    """Rows matching ``where``, summed per month they happened in and adapter."""
    r = UsageRecord
    month = utc_month(r.created_at)
    query = (
        select(
            month.label("month"),
            r.adapter_id,
            func.sum(r.prompt_tokens),
            func.sum(r.completion_tokens),
            func.sum(r.cached_tokens),
        )
        .where(where)
        .group_by(month, r.adapter_id)
    )
    usage = [
        BillableUsage(
            adapter_id=adapter_id,
            prompt_tokens=int(prompt or 0),
            completion_tokens=int(completion or 0),
            cached_tokens=int(cached or 0),
            period=period,
            incurred_in=str(incurred),
        )
        for incurred, adapter_id, prompt, completion, cached in session.execute(query)
    ]
    # Sorted here: NULLs order differently on SQLite and PostgreSQL.
    return sorted(usage, key=lambda u: (u.incurred_in, u.adapter_id or ""))


def unbilled_usage(session: Session, tenant_id: str, window: BillingWindow) -> list[BillableUsage]:
    """What a draft of ``window.period`` bills, as of now."""
    return _billable(session, _unbilled(tenant_id, window), window.period)


def claim_usage(session: Session, tenant_id: str, window: BillingWindow, invoice_id: str) -> None:
    """Stamp the window's unbilled rows with the invoice that bills them (finalisation)."""
    session.execute(
        update(UsageRecord)
        .where(_unbilled(tenant_id, window))
        .values(invoice_id=invoice_id)
        .execution_options(synchronize_session=False)
    )


def claimed_usage(session: Session, invoice_id: str, period: str) -> list[BillableUsage]:
    """What a final invoice bills: exactly the rows stamped with its id."""
    return _billable(session, UsageRecord.invoice_id == invoice_id, period)


# ------------------------------------------------------------------------------ hosting


def _spans(
    versions: Iterable[tuple[str, str, datetime, datetime, dict[str, Any]]],
) -> dict[str, list[tuple[datetime, datetime | None]]]:
    """adapter id -> [from, until) of each version that passed validation."""
    spans: dict[str, list[tuple[datetime, datetime | None]]] = defaultdict(list)
    for adapter_id, status, created_at, updated_at, report in versions:
        if status == AdapterStatus.READY:
            spans[adapter_id].append((created_at, None))
        elif status == AdapterStatus.DELETED and "error" not in (report or {}):
            # Deletion is a version's last change: updated_at is when it stopped.
            spans[adapter_id].append((created_at, updated_at))
    return spans


def _covered_seconds(
    spans: list[tuple[datetime, datetime | None]], start: datetime, end: datetime
) -> int:
    """Seconds of [start, end) inside the union of ``spans`` (open ends run to ``end``)."""
    clipped = sorted(
        (max(a, start), min(b or end, end)) for a, b in spans if a < end and (b or end) > start
    )
    covered = 0
    cursor = start
    for a, b in clipped:
        a = max(a, cursor)
        if b > a:
            covered += int((b - a).total_seconds())
            cursor = b
    return covered


def adapter_names(session: Session, adapter_ids: Iterable[str]) -> dict[str, str]:
    """Names of adapters (deleted ones too: an invoice may bill their last month)."""
    ids = sorted(set(adapter_ids))
    if not ids:
        return {}
    rows = session.execute(select(Adapter.id, Adapter.name).where(Adapter.id.in_(ids)))
    return {adapter_id: name for adapter_id, name in rows.tuples()}


def hosted_adapters(session: Session, tenant_id: str, period: str) -> list[HostedAdapter]:
    """The tenant's own adapters hosted in ``period``, each for its share of the month."""
    start, end = month_start(period), month_start(next_period(period))
    v = AdapterVersion
    rows = session.execute(
        select(v.adapter_id, v.status, v.created_at, v.updated_at, v.report)
        .join(Adapter, Adapter.id == v.adapter_id)
        .where(Adapter.tenant_id == tenant_id, v.created_at < end)
    )
    month_seconds = Decimal(int((end - start).total_seconds()))
    hosted = []
    for adapter_id, spans in sorted(_spans(rows.tuples()).items()):
        seconds = _covered_seconds(spans, start, end)
        # normalize(): 0.5, not 0.500000, on the invoice (months <= 1: no exponent form).
        months = (Decimal(seconds) / month_seconds).quantize(
            MONTHS_QUANTUM, rounding=ROUND_HALF_EVEN
        ).normalize()
        if months > 0:
            hosted.append(HostedAdapter(adapter_id=adapter_id, months=months))
    return hosted


# -------------------------------------------------------------------------------- plans


def plan_from_record(row: PlanRecord) -> PricePlan:
    return PricePlan.model_validate({
        "name": row.name,
        "currency": row.currency,
        "prompt_per_mtok": row.prompt_per_mtok,
        "completion_per_mtok": row.completion_per_mtok,
        "cached_prompt_per_mtok": row.cached_prompt_per_mtok,
        "adapter_month": row.adapter_month,
        "monthly_minimum": row.monthly_minimum,
        "volume_tiers": row.volume_tiers,
        "adapter_overrides": row.adapter_overrides,
    })


def plan_record(session: Session, name: str) -> PlanRecord | None:
    return session.scalar(select(PlanRecord).where(PlanRecord.name == name))


def tenant_plans(session: Session, tenant_ids: Iterable[str]) -> dict[str, PricePlan]:
    """tenant id -> its price plan, for the tenants that have one."""
    ids = sorted(set(tenant_ids))
    if not ids:
        return {}
    rows = session.execute(
        select(Tenant.id, PlanRecord)
        .join(PlanRecord, PlanRecord.name == Tenant.plan)
        .where(Tenant.id.in_(ids))
    )
    return {tenant_id: plan_from_record(plan) for tenant_id, plan in rows.tuples()}

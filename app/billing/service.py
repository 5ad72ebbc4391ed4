"""Billing in the database: price plans, and invoices generated from usage rows.

Rules (the pure core in ``app.billing.invoice`` does the arithmetic):

- Rounding: every line is ``quantity * unit_price`` computed exactly and rounded once,
  half-to-even, to the currency's minor unit; subtotal, adjustments and total are plain
  sums of rounded lines, so an invoice always adds up.
- An invoice is a pure function of the tenant's usage rows billed in the period, its
  plan and the adapters it hosted: generating again gives the same id and the same lines.
  A draft is recomputed on every generation; a final invoice never changes.
- Hosting (pro rata): a tenant's own adapter is hosted while it has a version that
  passed validation, from that version's upload until the adapter is deleted (versions
  that failed, and shared adapters, are billed to nobody). Its adapter-months in a
  period are the seconds of that time inside the period over the period's seconds,
  rounded half-to-even to 6 decimal places. Time still open runs to the period's end, so
  a draft does not depend on when it is made (a current month's draft bills the whole
  rest of the month).
- Late usage: finalising recomputes the draft one last time and stamps every usage row
  it bills with the invoice's id, in one transaction. A row that arrives later for a
  finalised month is billed in the first month after it whose invoice is not final, as
  an adjustment line at the plan's base (or the adapter's override) prices; each row is
  billed exactly once.
- Plans are immutable once created (invoices name them): to change prices, create a new
  plan and move tenants to it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import CursorResult, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.audit import record_audit
from app.billing import records, render
from app.billing.catalog import (
    PlanCreate,
    PlanView,
    create_plan,
    get_plan,
    list_plans,
    require_plan,
    tenant_plan,
)
from app.billing.invoice import BillableUsage, Invoice, build_invoice
from app.billing.periods import check_period
from app.billing.plans import PricePlan
from app.billing.views import InvoiceView, invoice_view
from app.core.errors import InvalidInput
from app.tables import InvoiceRecord, new_id, utcnow
from app.tenants import get_tenant, not_found

# The plans half of the interface lives in app/billing/catalog.py.
__all__ = [
    "InvoiceView",
    "PlanCreate",
    "PlanView",
    "create_plan",
    "finalize_invoice",
    "generate_invoice",
    "get_invoice",
    "get_plan",
    "invoice_csv",
    "invoice_html",
    "list_invoices",
    "list_plans",
    "require_plan",
]

# ----------------------------------------------------------------------------- invoices


def _parse_period(period: str) -> str:
    try:
        return check_period(period)
    except ValueError:
        raise InvalidInput(
            f"Invalid value for 'period': expected a month as 'YYYY-MM' (2026-03), "
            f"got '{period}'.",
            param="period",
        ) from None


def _invoice_row(session: Session, tenant_id: str, period: str) -> InvoiceRecord | None:
    return session.scalar(
        select(InvoiceRecord).where(
            InvoiceRecord.tenant_id == tenant_id, InvoiceRecord.period == period
        )
    )


def _draft(session: Session, tenant_id: str, period: str, plan: PricePlan) -> Invoice:
    window = records.billing_window(period, records.finalized_periods(session, tenant_id))
    return _build(session, tenant_id, period, plan,
                  records.unbilled_usage(session, tenant_id, window))


def _build(session: Session, tenant_id: str, period: str, plan: PricePlan,
           usage: list[BillableUsage]) -> Invoice:
    hosted = records.hosted_adapters(session, tenant_id, period)
    ids = [row.adapter_id for row in usage if row.adapter_id] + [h.adapter_id for h in hosted]
    return build_invoice(
        tenant_id=tenant_id,
        period=period,
        plan=plan,
        usage=usage,
        adapters_hosted=hosted,
        adapter_names=records.adapter_names(session, ids),
    )


def _rowcount(result: Any) -> int:
    assert isinstance(result, CursorResult), "an UPDATE returns a cursor result"
    return result.rowcount


def _audit(
    session: Session, action: str, row: InvoiceRecord, actor: str, request_id: str | None
) -> None:
    record_audit(
        session, actor=actor, action=action, target_type="invoice", target_id=row.id,
        details={"tenant_id": row.tenant_id, "period": row.period, "total": row.total,
                 "currency": row.currency, "plan": row.plan},
        request_id=request_id,
    )


def generate_invoice(
    session: Session, *, tenant_id: str, period: str, actor: str, request_id: str | None
) -> InvoiceView:
    """The tenant's invoice for `period`, created or recomputed (draft) or as it is (final).
    404 unknown tenant, 400 bad period or tenant without plan; the caller commits."""
    period = _parse_period(period)
    tenant = get_tenant(session, tenant_id=tenant_id)  # deleted tenants are still billed
    row = _invoice_row(session, tenant_id, period)
    if row is not None and row.status == "final":
        return invoice_view(row)
    invoice = _draft(session, tenant_id, period, tenant_plan(session, tenant))
    fields = {
        "status": "draft",
        "plan": invoice.plan,
        "currency": invoice.currency,
        "total": str(invoice.total),
        "document": invoice.model_dump(mode="json"),
    }
    if row is None:
        row = InvoiceRecord(id=new_id("inv"), tenant_id=tenant_id, period=period, **fields)
        session.add(row)
        try:
            session.flush()
        except IntegrityError:
            # NOTE: the same tenant and period generated concurrently; UNIQUE(tenant_id,
            # period) let one insert win. Recompute against the winner's row.
            session.rollback()
            return generate_invoice(
                session, tenant_id=tenant_id, period=period, actor=actor, request_id=request_id
            )
        _audit(session, "invoice.create", row, actor, request_id)
        return invoice_view(row)
    if row.document == fields["document"] and row.plan == fields["plan"]:
        return invoice_view(row)
    # Only while still a draft: a concurrent finalisation wins and is never overwritten.
    changed = _rowcount(session.execute(
        update(InvoiceRecord)
        .where(InvoiceRecord.id == row.id, InvoiceRecord.status == "draft")
        .values(**fields, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    ))
    session.refresh(row)
    if changed:
        _audit(session, "invoice.update", row, actor, request_id)
    return invoice_view(row)


def finalize_invoice(
    session: Session, invoice_id: str, *, actor: str, request_id: str | None
) -> InvoiceView:
    """Freeze the invoice: recomputed one last time from every unbilled row of its window,
    which are stamped with its id in the same transaction. Finalising a final invoice
    returns it unchanged. The caller commits."""
    row = session.get(InvoiceRecord, invoice_id)
    if row is None:
        raise not_found("invoice", invoice_id)
    if row.status == "final":
        return invoice_view(row)
    plan = tenant_plan(session, get_tenant(session, tenant_id=row.tenant_id))
    now = utcnow()
    # NOTE: a compare-and-set on the status makes this transaction the only one that
    # finalises the invoice (and orders it after any concurrent draft update).
    won = _rowcount(session.execute(
        update(InvoiceRecord)
        .where(InvoiceRecord.id == invoice_id, InvoiceRecord.status == "draft")
        .values(status="final", finalized_at=now, updated_at=now)
        .execution_options(synchronize_session=False)
    ))
    if not won:
        session.refresh(row)
        return invoice_view(row)
    finalized = records.finalized_periods(session, row.tenant_id) - {row.period}
    window = records.billing_window(row.period, finalized)
    records.claim_usage(session, row.tenant_id, window, invoice_id)
    invoice = _build(
        session, row.tenant_id, row.period, plan,
        records.claimed_usage(session, invoice_id, row.period),
    ).finalized()
    session.execute(
        update(InvoiceRecord)
        .where(InvoiceRecord.id == invoice_id)
        .values(
            plan=invoice.plan,
            currency=invoice.currency,
            total=str(invoice.total),
            document=invoice.model_dump(mode="json"),
        )
        .execution_options(synchronize_session=False)
    )
    session.refresh(row)
    _audit(session, "invoice.finalize", row, actor, request_id)
    return invoice_view(row)


def list_invoices(session: Session, *, tenant_id: str | None) -> list[InvoiceView]:
    """Newest period first."""
    query = select(InvoiceRecord)
    if tenant_id is not None:
        query = query.where(InvoiceRecord.tenant_id == tenant_id)
    query = query.order_by(
        InvoiceRecord.period.desc(), InvoiceRecord.tenant_id, InvoiceRecord.id
    )
    return [invoice_view(row) for row in session.scalars(query)]


def get_invoice(session: Session, invoice_id: str) -> InvoiceView | None:
    row = session.get(InvoiceRecord, invoice_id)
    return None if row is None else invoice_view(row)


def invoice_csv(view: InvoiceView) -> str:
    """One row per line, then a `total` row; amounts are decimal strings."""
    return render.invoice_csv(view)


def invoice_html(view: InvoiceView) -> str:
    """A standalone printable page."""
    return render.invoice_html(view)

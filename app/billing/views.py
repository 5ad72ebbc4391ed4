"""An invoice as the API, the admin UI and the renderers show it."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Literal

from pydantic import BaseModel

from app.billing.invoice import Invoice, InvoiceLine
from app.tables import InvoiceRecord


class InvoiceView(BaseModel):
    """An invoice as the API shows it; Decimals serialize as decimal strings."""

    object: Literal["invoice"] = "invoice"
    id: str
    tenant_id: str
    period: str  # "YYYY-MM"
    plan: str
    currency: str
    lines: list[InvoiceLine]
    subtotal: Decimal
    minimum_top_up: Decimal
    adjustments: Decimal
    total: Decimal
    status: Literal["draft", "final"]
    created_at: int  # unix seconds
    finalized_at: int | None


def _unix(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def invoice_view(row: InvoiceRecord) -> InvoiceView:
    invoice = Invoice.model_validate(row.document)
    return InvoiceView(
        id=row.id,
        tenant_id=row.tenant_id,
        period=row.period,
        plan=invoice.plan,
        currency=invoice.currency,
        lines=list(invoice.lines),
        subtotal=invoice.subtotal,
        minimum_top_up=invoice.minimum_top_up,
        adjustments=invoice.adjustments,
        total=invoice.total,
        status="final" if row.status == "final" else "draft",
        created_at=int(row.created_at.timestamp()),
        finalized_at=_unix(row.finalized_at),
    )

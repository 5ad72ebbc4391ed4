"""Billing: price plans and invoices computed as pure functions of usage (money is Decimal)."""

from app.billing.invoice import (
    Adjustment,
    BillableUsage,
    HostedAdapter,
    Invoice,
    InvoiceLine,
    build_invoice,
    line_amount,
    round_amount,
)
from app.billing.periods import billed_period, check_period, next_period, period_of
from app.billing.plans import PricePlan, TokenPrices, VolumeTier, minor_unit, minor_units

__all__ = [
    "Adjustment",
    "BillableUsage",
    "HostedAdapter",
    "Invoice",
    "InvoiceLine",
    "PricePlan",
    "TokenPrices",
    "VolumeTier",
    "billed_period",
    "build_invoice",
    "check_period",
    "line_amount",
    "minor_unit",
    "minor_units",
    "next_period",
    "period_of",
    "round_amount",
]

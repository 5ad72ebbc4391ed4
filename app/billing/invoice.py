"""An invoice as a pure function of a tenant's billable usage in a period and its plan.

The rounding rule (the only one): every line's ``amount`` is ``quantity * unit_price``
computed exactly and then rounded half-to-even to the currency's minor unit (0.01 for
USD/EUR, 1 for JPY, 0.001 for KWD); token lines count ``quantity`` in millions of tokens
and ``unit_price`` per million. Totals are plain sums of rounded line amounts, so an
invoice always adds up to the cent.

Token kinds: usage rows report ``cached_tokens`` as a subset of ``prompt_tokens``; the
uncached part (prompt - cached) is billed at the prompt price and the cached part at the
cached-prompt price.

Late usage: the caller tags each row with the period it is billed in (see
``periods.billed_period``; the database service applies the same rule to whole windows
of rows, ``records.billing_window``). Rows billed in this invoice's period but incurred
in an earlier one appear as ``adjustment`` lines, priced flat at the plan's base (or the adapter's
override) prices: the earlier month's volume is closed. They are not counted towards this
month's tiers or minimum. Manual credits and debits come in as ``Adjustment`` values.
"""

from __future__ import annotations

import decimal
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict

from app.billing.periods import check_period
from app.billing.plans import TOKEN_KINDS, PricePlan, TokenKind, TokenPrices, minor_unit

LineKind = Literal["prompt", "cached_prompt", "completion", "hosting", "minimum", "adjustment"]
InvoiceStatus = Literal["draft", "final"]

_MTOK = Decimal(1_000_000)
# Exact for every price the plan accepts (<= 24 significant digits) times any token count
# up to 10**30, so rounding happens once, at quantize().
_EXACT = decimal.Context(
    prec=80,
    rounding=ROUND_HALF_EVEN,
    traps=[decimal.Inexact, decimal.InvalidOperation, decimal.DivisionByZero, decimal.Overflow],
)
# The one place rounding happens (quantize signals Inexact, so it gets its own context).
_ROUNDING = decimal.Context(
    prec=80,
    rounding=ROUND_HALF_EVEN,
    traps=[decimal.InvalidOperation, decimal.DivisionByZero, decimal.Overflow],
)

_KIND_LABEL: dict[TokenKind, str] = {
    "prompt": "prompt tokens",
    "cached_prompt": "cached prompt tokens",
    "completion": "completion tokens",
}


@dataclass(frozen=True, slots=True)
class BillableUsage:
    """Tokens to bill (one usage row or an aggregate of them) and the period billed in.

    ``incurred_in`` is the month the usage happened; it defaults to ``period`` and is earlier
    for late usage that arrived after that month's invoice was finalised.
    """

    adapter_id: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    period: str
    incurred_in: str = ""

    def __post_init__(self) -> None:
        check_period(self.period)
        if not self.incurred_in:
            object.__setattr__(self, "incurred_in", self.period)
        check_period(self.incurred_in)
        if self.incurred_in > self.period:
            raise ValueError("usage cannot be billed before the month it happened")
        for count in (self.prompt_tokens, self.completion_tokens, self.cached_tokens):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError("token counts must be non-negative ints")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens are a subset of prompt_tokens")

    def tokens(self, kind: TokenKind) -> int:
        if kind == "prompt":
            return self.prompt_tokens - self.cached_tokens
        if kind == "cached_prompt":
            return self.cached_tokens
        return self.completion_tokens


@dataclass(frozen=True, slots=True)
class HostedAdapter:
    """An adapter kept deployable in the period; ``months`` < 1 for part of a month."""

    adapter_id: str
    months: Decimal = field(default=Decimal(1))

    def __post_init__(self) -> None:
        if not isinstance(self.months, Decimal) or not (0 <= self.months <= 1):
            raise ValueError("months must be a Decimal between 0 and 1")


@dataclass(frozen=True, slots=True)
class Adjustment:
    """A manual credit (negative) or debit, in the plan's currency, shown on this invoice."""

    description: str
    amount: Decimal
    incurred_in: str

    def __post_init__(self) -> None:
        check_period(self.incurred_in)
        if not isinstance(self.amount, Decimal) or not self.amount.is_finite():
            raise ValueError("amount must be a finite Decimal")


class InvoiceLine(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: LineKind
    description: str
    # Millions of tokens for token lines, adapter-months for hosting, 1 otherwise.
    quantity: Decimal
    unit_price: Decimal
    amount: Decimal
    adapter_id: str | None = None
    # The month the charge belongs to: the invoice's period except for adjustments.
    incurred_in: str
    # Token lines: the tokens counted (quantity is this in millions), so that a reader can
    # check the line against the usage report.
    tokens: int | None = None


class Invoice(BaseModel):
    model_config = ConfigDict(frozen=True)

    tenant_id: str
    period: str
    plan: str
    currency: str
    lines: tuple[InvoiceLine, ...]
    # Usage and hosting of the period, before the minimum and adjustments.
    subtotal: Decimal
    minimum_top_up: Decimal
    adjustments: Decimal
    # Sum of every line; negative when credits exceed charges (a balance in the tenant's favour).
    total: Decimal
    status: InvoiceStatus = "draft"

    @property
    def key(self) -> tuple[str, str]:
        """Unique per tenant and period: regenerating replaces, never duplicates."""
        return (self.tenant_id, self.period)

    def finalized(self) -> Invoice:
        return self.model_copy(update={"status": "final"})


def round_amount(value: Decimal, currency: str) -> Decimal:
    """The rounding rule: half-to-even to the currency's minor unit."""
    return value.quantize(minor_unit(currency), rounding=ROUND_HALF_EVEN, context=_ROUNDING)


def line_amount(quantity: Decimal, unit_price: Decimal, currency: str) -> Decimal:
    return round_amount(_EXACT.multiply(quantity, unit_price), currency)


def _mtok(tokens: int) -> Decimal:
    return _EXACT.divide(Decimal(tokens), _MTOK)


def token_amount(tokens: int, price_per_mtok: Decimal, currency: str) -> Decimal:
    """What `tokens` cost at a price per million tokens: one line's rounded amount."""
    return line_amount(_mtok(tokens), price_per_mtok, currency)


def _token_line(
    kind: LineKind,
    description: str,
    tokens: int,
    price: Decimal,
    currency: str,
    adapter_id: str | None,
    incurred_in: str,
) -> InvoiceLine:
    quantity = _mtok(tokens)
    return InvoiceLine(
        kind=kind,
        description=description,
        quantity=quantity,
        unit_price=price,
        amount=line_amount(quantity, price, currency),
        adapter_id=adapter_id,
        incurred_in=incurred_in,
        tokens=tokens,
    )


def _tiered_lines(plan: PricePlan, volume: dict[TokenKind, int], period: str) -> list[InvoiceLine]:
    lines = []
    for kind in TOKEN_KINDS:
        total = volume.get(kind, 0)
        for start, end, price in plan.bands(kind):
            tokens = max(0, min(total, end if end is not None else total) - start)
            if tokens == 0:
                continue
            label = _KIND_LABEL[kind]
            band = f"{start:,}+" if end is None else f"{start:,}-{end - 1:,}"
            description = label if len(plan.volume_tiers) == 0 else f"{label} ({band})"
            lines.append(_token_line(kind, description, tokens, price, plan.currency, None, period))
    return lines


def _adapter_label(adapter_id: str, names: Mapping[str, str]) -> str:
    name = names.get(adapter_id)
    return f"{name} ({adapter_id})" if name else adapter_id


def _usage_lines(
    plan: PricePlan, rows: Iterable[BillableUsage], period: str, names: Mapping[str, str]
) -> tuple[list[InvoiceLine], list[InvoiceLine]]:
    """(this period's usage lines, late-usage adjustment lines)."""
    tiered: dict[TokenKind, int] = defaultdict(int)
    flat: dict[tuple[str, str, TokenKind], int] = defaultdict(int)  # (incurred, adapter, kind)
    for row in rows:
        overridden = row.adapter_id is not None and row.adapter_id in plan.adapter_overrides
        late = row.incurred_in != period
        for kind in TOKEN_KINDS:
            if overridden or late:
                flat[(row.incurred_in, row.adapter_id or "", kind)] += row.tokens(kind)
            else:
                tiered[kind] += row.tokens(kind)
    current = _tiered_lines(plan, tiered, period)
    adjustments = []
    for (incurred, adapter, kind), tokens in sorted(flat.items()):
        if tokens == 0:
            continue
        adapter_id = adapter or None
        prices: TokenPrices = plan.adapter_overrides.get(adapter, plan.base_prices)
        label = _KIND_LABEL[kind] + (
            f", adapter {_adapter_label(adapter_id, names)}" if adapter_id else ""
        )
        if incurred == period:
            current.append(
                _token_line(
                    kind, label, tokens, prices.per_mtok(kind), plan.currency, adapter_id, incurred
                )
            )
        else:
            adjustments.append(
                _token_line(
                    "adjustment",
                    f"late usage from {incurred}: {label}",
                    tokens,
                    prices.per_mtok(kind),
                    plan.currency,
                    adapter_id,
                    incurred,
                )
            )
    return current, adjustments


def _hosting_lines(
    plan: PricePlan, hosted: Iterable[HostedAdapter], period: str, names: Mapping[str, str]
) -> list[InvoiceLine]:
    months: dict[str, Decimal] = defaultdict(Decimal)
    for item in hosted:
        months[item.adapter_id] = _EXACT.add(months[item.adapter_id], item.months)
    return [
        InvoiceLine(
            kind="hosting",
            description=f"adapter hosting, {_adapter_label(adapter_id, names)}",
            quantity=quantity,
            unit_price=plan.adapter_month,
            amount=line_amount(quantity, plan.adapter_month, plan.currency),
            adapter_id=adapter_id,
            incurred_in=period,
        )
        for adapter_id, quantity in sorted(months.items())
        if quantity > 0
    ]


def _sum(amounts: Iterable[Decimal], currency: str) -> Decimal:
    total = round_amount(Decimal(0), currency)
    for amount in amounts:
        total = _EXACT.add(total, amount)
    return total


def build_invoice(
    *,
    tenant_id: str,
    period: str,
    plan: PricePlan,
    usage: Sequence[BillableUsage],
    adapters_hosted: Sequence[HostedAdapter] = (),
    previous_adjustments: Sequence[Adjustment] = (),
    adapter_names: Mapping[str, str] | None = None,
) -> Invoice:
    """The invoice for ``tenant_id`` in ``period`` (a draft; see ``Invoice.finalized``).
    ``adapter_names`` (adapter id -> name) only labels the lines of those adapters.

    ``usage`` holds the rows billed in ``period`` (rows of other periods are a caller bug and
    raise ValueError). The result does not depend on the order of any input.
    """
    check_period(period)
    stray = sorted({row.period for row in usage if row.period != period})
    if stray:
        raise ValueError(f"usage billed in {stray} passed to the invoice for {period}")
    currency = plan.currency
    names = adapter_names or {}
    current, late = _usage_lines(plan, usage, period, names)
    current += _hosting_lines(plan, adapters_hosted, period, names)
    subtotal = _sum((line.amount for line in current), currency)

    minimum = round_amount(plan.monthly_minimum, currency)
    top_up = round_amount(Decimal(0), currency)
    if subtotal < minimum:
        top_up = _EXACT.subtract(minimum, subtotal)
        current.append(
            InvoiceLine(
                kind="minimum",
                description=f"monthly minimum {minimum} {currency}",
                quantity=Decimal(1),
                unit_price=top_up,
                amount=top_up,
                incurred_in=period,
            )
        )

    for item in previous_adjustments:
        if item.incurred_in > period:
            raise ValueError(f"adjustment for {item.incurred_in} on the invoice for {period}")
    manual = [
        InvoiceLine(
            kind="adjustment",
            description=item.description,
            quantity=Decimal(1),
            unit_price=round_amount(item.amount, currency),
            amount=round_amount(item.amount, currency),
            incurred_in=item.incurred_in,
        )
        for item in sorted(
            previous_adjustments, key=lambda a: (a.incurred_in, a.description, a.amount)
        )
    ]
    adjustments = [*late, *manual]
    adjustments_total = _sum((line.amount for line in adjustments), currency)
    lines = (*current, *adjustments)
    return Invoice(
        tenant_id=tenant_id,
        period=period,
        plan=plan.name,
        currency=currency,
        lines=lines,
        subtotal=subtotal,
        minimum_top_up=top_up,
        adjustments=adjustments_total,
        total=_sum((line.amount for line in lines), currency),
    )

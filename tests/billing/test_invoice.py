"""Invoices: property tests over random plans and usage, plus hand-computed examples."""

from __future__ import annotations

import decimal
import random
from collections import defaultdict
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from app.billing import (
    Adjustment,
    BillableUsage,
    HostedAdapter,
    Invoice,
    PricePlan,
    TokenPrices,
    VolumeTier,
    billed_period,
    build_invoice,
    minor_unit,
    next_period,
    period_of,
)
from app.billing.plans import TOKEN_KINDS

PERIOD = "2026-11"
EARLIER = ("2026-09", "2026-10")
ADAPTERS = (None, "ad_1", "ad_2", "ad_3", "ad_4")
# Keeps the file within ~10 s on a busy two-core machine.
FAST = settings(max_examples=150, deadline=None)


# --- strategies -------------------------------------------------------------------------

prices = st.builds(lambda n, e: Decimal(n).scaleb(-e), st.integers(0, 10**7), st.integers(0, 6))
token_prices = st.builds(
    TokenPrices,
    prompt_per_mtok=prices,
    completion_per_mtok=prices,
    cached_prompt_per_mtok=prices,
)


@st.composite
def plans(draw: st.DrawFn) -> PricePlan:
    currency = draw(st.sampled_from(["USD", "EUR", "JPY", "KWD"]))
    starts = sorted(draw(st.sets(st.integers(1, 8_000_000), max_size=3)))
    tiers = [VolumeTier(from_tokens=s, prices=draw(token_prices)) for s in starts]
    overridden = draw(st.sets(st.sampled_from(ADAPTERS[1:]), max_size=2))
    minimum = Decimal(draw(st.integers(0, 10**6))) * minor_unit(currency)
    return PricePlan(
        name="random",
        currency=currency,
        prompt_per_mtok=draw(prices),
        completion_per_mtok=draw(prices),
        cached_prompt_per_mtok=draw(prices),
        adapter_month=draw(prices),
        monthly_minimum=minimum,
        volume_tiers=tuple(tiers),
        adapter_overrides={a: draw(token_prices) for a in sorted(overridden)},
    )


@st.composite
def usage_rows(draw: st.DrawFn, late: bool = True) -> BillableUsage:
    prompt = draw(st.integers(0, 5_000_000))
    incurred = draw(st.sampled_from((PERIOD, *EARLIER))) if late else PERIOD
    return BillableUsage(
        adapter_id=draw(st.sampled_from(ADAPTERS)),
        prompt_tokens=prompt,
        completion_tokens=draw(st.integers(0, 5_000_000)),
        cached_tokens=draw(st.integers(0, prompt)),
        period=PERIOD,
        incurred_in=incurred,
    )


hosted = st.builds(
    HostedAdapter,
    adapter_id=st.sampled_from(ADAPTERS[1:]),
    months=st.sampled_from([Decimal(1), Decimal("0.5"), Decimal("0.3333"), Decimal(0)]),
)
adjustments = st.builds(
    Adjustment,
    description=st.sampled_from(["credit: outage", "goodwill", "correction"]),
    amount=st.integers(-10_000, 10_000).map(lambda c: Decimal(c).scaleb(-2)),
    incurred_in=st.sampled_from((PERIOD, *EARLIER)),
)
inputs = st.fixed_dictionaries(
    {
        "plan": plans(),
        "usage": st.lists(usage_rows(), max_size=12),
        "adapters_hosted": st.lists(hosted, max_size=4),
        "previous_adjustments": st.lists(adjustments, max_size=3),
    }
)


def invoice(**kwargs: object) -> Invoice:
    return build_invoice(tenant_id="ten_1", period=PERIOD, **kwargs)  # type: ignore[arg-type]


def expected_amount(quantity: Decimal, unit_price: Decimal, currency: str) -> Decimal:
    with decimal.localcontext(decimal.Context(prec=100)):
        return (quantity * unit_price).quantize(minor_unit(currency), rounding=ROUND_HALF_EVEN)


# --- properties ---------------------------------------------------------------------------


@FAST
@given(inputs)
def test_totals_are_sums_of_rounded_lines(args: dict[str, object]) -> None:
    inv = invoice(**args)
    quantum = minor_unit(inv.currency)
    for line in inv.lines:
        assert line.amount == expected_amount(line.quantity, line.unit_price, inv.currency)
        assert line.amount.as_tuple().exponent == quantum.as_tuple().exponent
    assert inv.total == sum((line.amount for line in inv.lines), Decimal(0))
    usage_and_hosting = [ln for ln in inv.lines if ln.kind not in ("minimum", "adjustment")]
    assert inv.subtotal == sum((ln.amount for ln in usage_and_hosting), Decimal(0))
    adjusted = [ln for ln in inv.lines if ln.kind == "adjustment"]
    assert inv.adjustments == sum((ln.amount for ln in adjusted), Decimal(0))
    assert inv.total == inv.subtotal + inv.minimum_top_up + inv.adjustments


@FAST
@given(inputs, st.randoms(use_true_random=False))
def test_regenerating_in_any_order_gives_the_identical_invoice(
    args: dict[str, object], rng: random.Random
) -> None:
    first = invoice(**args)
    shuffled = {k: rng.sample(v, len(v)) if isinstance(v, list) else v for k, v in args.items()}
    again = invoice(**shuffled)
    assert again == first
    assert again.model_dump_json() == first.model_dump_json()


@FAST
@given(plans(), st.lists(usage_rows(), min_size=1, max_size=8), st.data())
def test_splitting_a_row_changes_nothing(
    plan: PricePlan, rows: list[BillableUsage], data: st.DataObject
) -> None:
    whole = rows[0]
    cached = data.draw(st.integers(0, whole.cached_tokens))
    prompt = data.draw(st.integers(cached, whole.prompt_tokens - (whole.cached_tokens - cached)))
    completion = data.draw(st.integers(0, whole.completion_tokens))
    part = BillableUsage(whole.adapter_id, prompt, completion, cached, PERIOD, whole.incurred_in)
    rest = BillableUsage(
        whole.adapter_id,
        whole.prompt_tokens - prompt,
        whole.completion_tokens - completion,
        whole.cached_tokens - cached,
        PERIOD,
        whole.incurred_in,
    )
    assert invoice(plan=plan, usage=[part, rest, *rows[1:]]) == invoice(plan=plan, usage=rows)


@FAST
@given(plans(), st.lists(usage_rows(), max_size=8), usage_rows(late=False))
def test_more_tokens_never_cost_less(
    plan: PricePlan, rows: list[BillableUsage], extra: BillableUsage
) -> None:
    before = invoice(plan=plan, usage=rows)
    after = invoice(plan=plan, usage=[*rows, extra])
    assert after.subtotal >= before.subtotal
    assert after.total >= before.total


@FAST
@given(plans(), st.lists(usage_rows(late=False), max_size=8))
def test_token_lines_bill_every_token_once(plan: PricePlan, rows: list[BillableUsage]) -> None:
    inv = invoice(plan=plan, usage=rows)
    billed: dict[tuple[str | None, str], Decimal] = defaultdict(Decimal)
    for line in inv.lines:
        if line.kind in ("prompt", "cached_prompt", "completion"):
            billed[(line.adapter_id, line.kind)] += line.quantity
    wanted: dict[tuple[str | None, str], Decimal] = defaultdict(Decimal)
    for r in rows:
        adapter = r.adapter_id if r.adapter_id in plan.adapter_overrides else None
        for kind in TOKEN_KINDS:
            wanted[(adapter, kind)] += Decimal(r.tokens(kind)) / 1_000_000
    assert {k: v for k, v in billed.items() if v} == {k: v for k, v in wanted.items() if v}


@FAST
@given(inputs)
def test_minimum_applies_exactly_below_it(args: dict[str, object]) -> None:
    inv = invoice(**args)
    plan = args["plan"]
    assert isinstance(plan, PricePlan)
    minimum_lines = [ln for ln in inv.lines if ln.kind == "minimum"]
    if inv.subtotal < plan.monthly_minimum:
        assert len(minimum_lines) == 1
        assert inv.subtotal + inv.minimum_top_up == plan.monthly_minimum
        assert minimum_lines[0].amount == inv.minimum_top_up > 0
    else:
        assert minimum_lines == []
        assert inv.minimum_top_up == 0


@FAST
@given(inputs, st.lists(usage_rows(), max_size=6))
def test_late_usage_only_adds_adjustment_lines(
    args: dict[str, object], more: list[BillableUsage]
) -> None:
    usage = args["usage"]
    assert isinstance(usage, list)
    current = [r for r in usage if r.incurred_in == PERIOD]
    late = [r for r in [*usage, *more] if r.incurred_in != PERIOD]
    base = invoice(**{**args, "usage": current})
    with_late = invoice(**{**args, "usage": [*current, *late]})
    assert [ln for ln in with_late.lines if ln.kind != "adjustment"] == [
        ln for ln in base.lines if ln.kind != "adjustment"
    ]
    assert with_late.subtotal == base.subtotal
    assert with_late.minimum_top_up == base.minimum_top_up
    for line in with_late.lines:
        assert (line.incurred_in == PERIOD) or line.kind == "adjustment"
    late_tokens: dict[tuple[str, str | None], Decimal] = defaultdict(Decimal)
    for line in with_late.lines:
        if line.kind == "adjustment" and line.description.startswith("late usage"):
            late_tokens[(line.incurred_in, line.adapter_id)] += line.quantity
    wanted: dict[tuple[str, str | None], Decimal] = defaultdict(Decimal)
    for r in late:
        wanted[(r.incurred_in, r.adapter_id)] += (
            Decimal(r.prompt_tokens + r.completion_tokens) / 1_000_000
        )
    assert {k: v for k, v in late_tokens.items() if v} == {k: v for k, v in wanted.items() if v}


# --- examples with hand-computed figures --------------------------------------------------


def usd_plan(**overrides: object) -> PricePlan:
    fields: dict[str, object] = {
        "name": "standard",
        "currency": "USD",
        "prompt_per_mtok": "2",
        "completion_per_mtok": "8",
        "cached_prompt_per_mtok": "0.50",
    }
    return PricePlan.model_validate({**fields, **overrides})


def row(prompt: int, completion: int = 0, cached: int = 0, **kw: object) -> BillableUsage:
    return BillableUsage(
        adapter_id=kw.get("adapter_id"),  # type: ignore[arg-type]
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        period=str(kw.get("period", PERIOD)),
        incurred_in=str(kw.get("incurred_in", "")),
    )


def amounts(inv: Invoice) -> list[tuple[str, str]]:
    return [(line.kind, str(line.amount)) for line in inv.lines]


def test_cached_tokens_are_billed_at_the_cached_price() -> None:
    inv = invoice(plan=usd_plan(), usage=[row(1_000_000, 250_000, 500_000), row(500_000)])
    # uncached 1.0M x $2 = 2.00; cached 0.5M x $0.50 = 0.25; completion 0.25M x $8 = 2.00
    assert amounts(inv) == [("prompt", "2.00"), ("cached_prompt", "0.25"), ("completion", "2.00")]
    assert (inv.subtotal, inv.total) == (Decimal("4.25"), Decimal("4.25"))
    assert inv.lines[0].quantity == Decimal("1") and inv.lines[0].unit_price == Decimal(2)


def test_rounding_is_half_even_per_line() -> None:
    plan = usd_plan(prompt_per_mtok="1")
    assert amounts(invoice(plan=plan, usage=[row(5_000)])) == [("prompt", "0.00")]
    assert amounts(invoice(plan=plan, usage=[row(15_000)])) == [("prompt", "0.02")]
    assert amounts(invoice(plan=plan, usage=[row(25_000)])) == [("prompt", "0.02")]
    jpy = usd_plan(currency="JPY", prompt_per_mtok="150")
    assert amounts(invoice(plan=jpy, usage=[row(10_000)])) == [("prompt", "2")]  # 1.5
    assert amounts(invoice(plan=jpy, usage=[row(30_000)])) == [("prompt", "4")]  # 4.5


def test_volume_tiers_are_graduated() -> None:
    plan = usd_plan(
        prompt_per_mtok="3",
        volume_tiers=[
            {
                "from_tokens": 1_000_000,
                "prices": {
                    "prompt_per_mtok": "2",
                    "completion_per_mtok": "8",
                    "cached_prompt_per_mtok": "0.5",
                },
            },
            {
                "from_tokens": 3_000_000,
                "prices": {
                    "prompt_per_mtok": "1",
                    "completion_per_mtok": "8",
                    "cached_prompt_per_mtok": "0.5",
                },
            },
        ],
    )
    inv = invoice(plan=plan, usage=[row(2_500_000), row(1_500_000)])
    # 1M x $3 + 2M x $2 + 1M x $1
    assert amounts(inv) == [("prompt", "3.00"), ("prompt", "4.00"), ("prompt", "1.00")]
    assert [ln.description for ln in inv.lines] == [
        "prompt tokens (0-999,999)",
        "prompt tokens (1,000,000-2,999,999)",
        "prompt tokens (3,000,000+)",
    ]
    assert inv.total == Decimal("8.00")


def test_overrides_hosting_minimum_and_adjustments() -> None:
    plan = usd_plan(
        adapter_month="5",
        monthly_minimum="20",
        adapter_overrides={
            "ad_x": {
                "prompt_per_mtok": "1",
                "completion_per_mtok": "4",
                "cached_prompt_per_mtok": "0.25",
            },
        },
    )
    inv = invoice(
        plan=plan,
        usage=[
            row(1_000_000, adapter_id="ad_x"),  # override: $1.00
            row(1_000_000, adapter_id="ad_y"),  # plan: $2.00
            row(0, 500_000, incurred_in="2026-10"),  # late: 0.5M x $8 = $4.00
        ],
        adapters_hosted=[HostedAdapter("ad_y", Decimal("0.5")), HostedAdapter("ad_x")],
        previous_adjustments=[Adjustment("credit: outage", Decimal("-1.50"), "2026-10")],
    )
    assert amounts(inv) == [
        ("prompt", "2.00"),
        ("prompt", "1.00"),
        ("hosting", "5.00"),
        ("hosting", "2.50"),
        ("minimum", "9.50"),
        ("adjustment", "4.00"),
        ("adjustment", "-1.50"),
    ]
    assert inv.lines[1].adapter_id == "ad_x"
    assert inv.lines[5].description == "late usage from 2026-10: completion tokens"
    assert inv.lines[5].incurred_in == "2026-10"
    assert (inv.subtotal, inv.minimum_top_up, inv.adjustments, inv.total) == (
        Decimal("10.50"),
        Decimal("9.50"),
        Decimal("2.50"),
        Decimal("22.50"),
    )
    assert inv.status == "draft" and inv.finalized().status == "final"
    assert inv.finalized().lines == inv.lines and inv.key == ("ten_1", PERIOD)


def test_late_usage_goes_to_the_first_open_period() -> None:
    october = datetime(2026, 10, 31, 23, 59, tzinfo=UTC)
    assert period_of(october) == "2026-10"
    assert billed_period(october, last_finalized=None) == "2026-10"
    assert billed_period(october, last_finalized="2026-09") == "2026-10"
    assert billed_period(october, last_finalized="2026-10") == "2026-11"
    assert billed_period(october, last_finalized="2026-11") == "2026-12"
    assert next_period("2026-12") == "2027-01"
    finalized = invoice(plan=usd_plan(), usage=[row(1_000_000)]).finalized()
    # The late row is billed in the next period; October's invoice is built from its own rows.
    late = row(
        1_000_000, period=billed_period(october, last_finalized="2026-11"), incurred_in="2026-10"
    )
    december = build_invoice(tenant_id="ten_1", period="2026-12", plan=usd_plan(), usage=[late])
    assert amounts(december) == [("adjustment", "2.00")]
    assert invoice(plan=usd_plan(), usage=[row(1_000_000)]).finalized() == finalized


def test_plan_refuses_floats_negatives_and_unknown_fields() -> None:
    assert usd_plan(prompt_per_mtok="0.1").prompt_per_mtok == Decimal("0.1")
    assert usd_plan(prompt_per_mtok=3).prompt_per_mtok == Decimal(3)
    bad: list[dict[str, object]] = [
        {"prompt_per_mtok": 0.1},
        {"prompt_per_mtok": "-1"},
        {"prompt_per_mtok": "NaN"},
        {"prompt_per_mtok": "1e-13"},
        {"currency": "usd"},
        {"monthly_minimum": "1.005"},
        {"discount": "5"},
        {
            "volume_tiers": [
                {
                    "from_tokens": 10,
                    "prices": {
                        "prompt_per_mtok": "1",
                        "completion_per_mtok": "1",
                        "cached_prompt_per_mtok": "1",
                    },
                },
                {
                    "from_tokens": 10,
                    "prices": {
                        "prompt_per_mtok": "1",
                        "completion_per_mtok": "1",
                        "cached_prompt_per_mtok": "1",
                    },
                },
            ]
        },
    ]
    for overrides in bad:
        with pytest.raises(ValidationError):
            usd_plan(**overrides)


def test_bad_usage_is_refused() -> None:
    with pytest.raises(ValueError, match="subset"):
        row(10, cached=11)
    with pytest.raises(ValueError, match="before the month"):
        row(10, incurred_in="2026-12")
    with pytest.raises(ValueError, match="YYYY-MM"):
        row(10, period="2026-13")
    with pytest.raises(ValueError, match="billed in"):
        invoice(plan=usd_plan(), usage=[row(10, period="2026-10")])

"""Billing in the database, on SQLite and PostgreSQL: plans round-trip digit for digit,
an invoice generated from usage rows equals the pure core's invoice of the same data,
regenerating changes nothing, and late usage after finalisation is billed exactly once,
in the next open month, without touching the final invoice."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from app.api.errors import service_error
from app.audit import AuditContext, list_audit
from app.billing import (
    BillableUsage,
    HostedAdapter,
    Invoice,
    PricePlan,
    build_invoice,
    period_of,
)
from app.billing.records import hosted_adapters
from app.billing.service import (
    InvoiceView,
    PlanCreate,
    create_plan,
    finalize_invoice,
    generate_invoice,
    get_invoice,
    get_plan,
    list_invoices,
    list_plans,
)
from app.core.errors import ServiceError
from app.db import make_engine, session_factory, session_scope
from app.tables import (
    Adapter,
    AdapterStatus,
    AdapterVersion,
    InvoiceRecord,
    UsageRecord,
    UsageStatus,
    new_id,
)
from app.tenants import create_tenant
from tests.utils.databases import migrated_database

BY = AuditContext(actor="test")
OCT = "2026-10"
NOV = "2026-11"
DEC = "2026-12"
OCT_5 = datetime(2026, 10, 5, 12, tzinfo=UTC)
NOV_1 = datetime(2026, 11, 1, tzinfo=UTC)
DEC_1 = datetime(2026, 12, 1, tzinfo=UTC)
OVERRIDDEN = "ad_override00001"

PRO = PlanCreate.model_validate({
    "name": "pro",
    "currency": "USD",
    "prompt_per_mtok": "1.50",
    "completion_per_mtok": "6.000",
    "cached_prompt_per_mtok": "0.375",
    "adapter_month": "20",
    "monthly_minimum": "5.00",
    "volume_tiers": [{"from_tokens": 1_000_000, "prices": {
        "prompt_per_mtok": "1.2", "completion_per_mtok": "5", "cached_prompt_per_mtok": "0.3"}}],
    "adapter_overrides": {OVERRIDDEN: {
        "prompt_per_mtok": "0.000123456789", "completion_per_mtok": "9.99",
        "cached_prompt_per_mtok": "0"}},
})


@pytest.fixture
def db(database_url: str) -> Iterator[sessionmaker[Session]]:
    if make_url(database_url).get_backend_name() == "postgresql":
        # A session time zone far from UTC: months must still be UTC months.
        engine = make_engine(database_url, connect_args={
            "connect_timeout": 5, "options": "-c timezone=Pacific/Auckland"})
    else:
        engine = make_engine(database_url)
    yield session_factory(engine)
    engine.dispose()


def new_tenant(db: sessionmaker[Session], name: str, plan: str | None = "pro") -> str:
    with session_scope(db) as session:
        return create_tenant(session, name=name, plan=plan, by=BY).id


def new_plan(db: sessionmaker[Session], body: PlanCreate = PRO) -> None:
    with session_scope(db) as session:
        create_plan(session, body, actor="test", request_id=None)


def add_usage(
    db: sessionmaker[Session],
    tenant_id: str,
    at: datetime,
    *,
    adapter: str | None = None,
    prompt: int = 1000,
    completion: int = 500,
    cached: int = 0,
) -> int:
    with session_scope(db) as session:
        row = UsageRecord(
            request_id=new_id("req"), tenant_id=tenant_id, key_id=None, model="m",
            adapter_id=adapter, adapter_version=None, prompt_tokens=prompt,
            completion_tokens=completion, cached_tokens=cached, ttft_ms=1.0, latency_ms=2.0,
            status=UsageStatus.OK.value, created_at=at,
        )
        session.add(row)
        session.flush()
        return row.id


def generate(db: sessionmaker[Session], tenant_id: str, period: str) -> InvoiceView:
    with session_scope(db) as session:
        return generate_invoice(
            session, tenant_id=tenant_id, period=period, actor="test", request_id="req-1"
        )


def finalize(db: sessionmaker[Session], invoice_id: str) -> InvoiceView:
    with session_scope(db) as session:
        return finalize_invoice(session, invoice_id, actor="test", request_id=None)


def plan_of(db: sessionmaker[Session], name: str = "pro") -> PricePlan:
    with session_scope(db) as session:
        view = get_plan(session, name)
    assert view is not None
    return PricePlan.model_validate(view.model_dump(exclude={"object", "created_at"}))


def billable(rows: list[tuple[datetime, str | None, int, int, int]], period: str) -> list[
    BillableUsage
]:
    return [
        BillableUsage(adapter_id=adapter, prompt_tokens=p, completion_tokens=c,
                      cached_tokens=k, period=period, incurred_in=period_of(at))
        for at, adapter, p, c, k in rows
    ]


def same_invoice(view: InvoiceView, expected: Invoice) -> bool:
    """Field for field, money compared as the decimal strings the API shows."""
    fields = set(expected.model_fields)
    return view.model_dump(mode="json", include=fields) == expected.model_dump(mode="json")


def variant(**changes: object) -> PlanCreate:
    return PlanCreate.model_validate({**PRO.model_dump(), **changes})


def assert_adds_up(view: InvoiceView) -> None:
    assert view.total == sum((line.amount for line in view.lines), Decimal(0))
    assert view.total == view.subtotal + view.minimum_top_up + view.adjustments


# ---------------------------------------------------------------------------------- plans


def test_plans_round_trip_digit_for_digit(db: sessionmaker[Session]) -> None:
    new_plan(db)
    new_plan(db, variant(name="cheap", currency="JPY", monthly_minimum=0))
    with session_scope(db) as session:
        got = get_plan(session, "pro")
        names = [p.name for p in list_plans(session)]
        missing = get_plan(session, "nope")
    assert names == ["cheap", "pro"] and missing is None
    assert got is not None
    dumped = got.model_dump(mode="json")
    assert dumped["prompt_per_mtok"] == "1.50"
    assert dumped["completion_per_mtok"] == "6.000"
    assert dumped["adapter_overrides"][OVERRIDDEN]["prompt_per_mtok"] == "0.000123456789"
    assert dumped["volume_tiers"] == [{"from_tokens": 1_000_000, "prices": {
        "prompt_per_mtok": "1.2", "completion_per_mtok": "5", "cached_prompt_per_mtok": "0.3"}}]
    assert plan_of(db) == PricePlan.model_validate(PRO.model_dump())


def test_duplicate_plan_is_409_and_creation_is_audited(db: sessionmaker[Session]) -> None:
    new_plan(db)
    with pytest.raises(ServiceError) as raised, session_scope(db) as session:
        create_plan(session, PRO, actor="test", request_id=None)
    assert service_error(raised.value).status_code == 409
    with session_scope(db) as session:
        entries = list_audit(session, action="plan.create")
        assert [(e.target_id, e.details["prompt_per_mtok"]) for e in entries] == [("pro", "1.50")]


# ------------------------------------------------------------------------------- invoices


def add_adapter(
    db: sessionmaker[Session],
    tenant_id: str | None,
    versions: list[tuple[AdapterStatus, datetime, datetime, dict[str, str]]],
    adapter_id: str | None = None,
    name: str | None = None,
) -> str:
    with session_scope(db) as session:
        adapter = Adapter(id=adapter_id or new_id("ad"), tenant_id=tenant_id,
                          owner=tenant_id or "shared", name=name or new_id("name"))
        session.add(adapter)
        session.flush()
        for number, (status, created, updated, report) in enumerate(versions, start=1):
            session.add(AdapterVersion(
                id=new_id("adv"), adapter_id=adapter.id, version=number, status=status.value,
                report=report, created_at=created, updated_at=updated,
            ))
        return adapter.id


def test_hosting_is_pro_rata_over_the_union_of_deployable_spans(
    db: sessionmaker[Session],
) -> None:
    tenant = new_tenant(db, "acme")
    ready, deleted, failed = AdapterStatus.READY, AdapterStatus.DELETED, AdapterStatus.FAILED
    day = timedelta(days=1)
    # From the 10th on: 21 of November's 30 days.
    late = add_adapter(db, tenant, [(ready, NOV_1 + 9 * day, NOV_1 + 9 * day, {})])
    # Deleted on the 16th: 15 days.
    gone = add_adapter(db, tenant, [(deleted, OCT_5, NOV_1 + 15 * day, {"rank": "8"})])
    # Deleted until the 6th, then revived on the 25th: 5 + 6 days, 11/30 rounded.
    revived = add_adapter(db, tenant, [
        (deleted, OCT_5, NOV_1 + 5 * day, {}),
        (ready, NOV_1 + 24 * day, NOV_1 + 24 * day, {}),
    ])
    # Two versions at once count once: the whole month.
    twice = add_adapter(db, tenant, [(ready, OCT_5, OCT_5, {}), (ready, OCT_5, OCT_5, {})])
    # Never deployable, shared, or after the month: nothing.
    add_adapter(db, tenant, [(failed, NOV_1, NOV_1, {"error": "bad"}),
                             (deleted, NOV_1, NOV_1 + day, {"error": "bad"})])
    add_adapter(db, None, [(ready, OCT_5, OCT_5, {})])
    add_adapter(db, tenant, [(ready, DEC_1, DEC_1, {})])
    with session_scope(db) as session:
        hosted = hosted_adapters(session, tenant, NOV)
        october = hosted_adapters(session, tenant, OCT)
    assert hosted == sorted([
        HostedAdapter(adapter_id=late, months=Decimal("0.700000")),
        HostedAdapter(adapter_id=gone, months=Decimal("0.500000")),
        HostedAdapter(adapter_id=revived, months=Decimal("0.366667")),
        HostedAdapter(adapter_id=twice, months=Decimal("1.000000")),
    ], key=lambda h: h.adapter_id)
    # October: from the 5th at noon, 26.5 of 31 days, for three of them.
    share = Decimal("0.854839")
    assert october == sorted([HostedAdapter(adapter_id=a, months=share)
                              for a in (gone, revived, twice)], key=lambda h: h.adapter_id)


def test_invoice_from_rows_equals_the_core_invoice(db: sessionmaker[Session]) -> None:
    new_plan(db)
    tenant = new_tenant(db, "acme")
    other = new_tenant(db, "globex")
    hosted = add_adapter(db, tenant, [(AdapterStatus.READY, OCT_5, OCT_5, {})],
                         name="support-bot")
    rows = [
        (NOV_1, None, 700_000, 90_000, 100_000),
        (NOV_1 + timedelta(days=3), hosted, 600_000, 10_000, 0),
        (DEC_1 - timedelta(microseconds=1), OVERRIDDEN, 333_333, 77_777, 11_111),
        (NOV_1 + timedelta(hours=5), None, 1, 1, 1),
    ]
    for at, adapter, p, c, k in rows:
        add_usage(db, tenant, at, adapter=adapter, prompt=p, completion=c, cached=k)
    # Not billed here: another month, another tenant.
    add_usage(db, tenant, NOV_1 - timedelta(microseconds=1), prompt=10**6)
    add_usage(db, tenant, DEC_1, prompt=10**6)
    add_usage(db, other, NOV_1, prompt=10**6)

    view = generate(db, tenant, NOV)
    expected = build_invoice(
        tenant_id=tenant, period=NOV, plan=plan_of(db), usage=billable(rows, NOV),
        adapters_hosted=[HostedAdapter(adapter_id=hosted, months=Decimal(1))],
        adapter_names={hosted: "support-bot"},
    )
    assert same_invoice(view, expected)
    assert {line.kind for line in view.lines} >= {"prompt", "completion", "hosting"}
    # Lines name the adapter (an id without a row stays an id) and count their tokens.
    described = {(line.kind, line.adapter_id): line for line in view.lines}

    def tokens(kind: str) -> int:  # over the plan's volume bands
        return sum(line.tokens or 0 for line in view.lines
                   if line.kind == kind and line.adapter_id is None)

    assert described[("hosting", hosted)].description == (
        f"adapter hosting, support-bot ({hosted})"
    )
    assert described[("prompt", OVERRIDDEN)].description.endswith(f"adapter {OVERRIDDEN}")
    # Prompt lines count the uncached prompt tokens; cached ones have their own line.
    assert described[("prompt", OVERRIDDEN)].tokens == 333_333 - 11_111
    assert tokens("prompt") == (700_000 - 100_000) + 600_000 + (1 - 1)
    assert tokens("cached_prompt") == 100_000 + 1
    assert view.status == "draft" and view.finalized_at is None
    assert_adds_up(view)


def test_regenerating_gives_the_identical_invoice(db: sessionmaker[Session]) -> None:
    new_plan(db)
    tenant = new_tenant(db, "acme")
    add_usage(db, tenant, NOV_1, prompt=123_456, completion=7_890)
    first = generate(db, tenant, NOV)
    again = generate(db, tenant, NOV)
    assert again.model_dump_json() == first.model_dump_json()
    with session_scope(db) as session:
        assert session.scalar(select(func.count()).select_from(InvoiceRecord)) == 1
        actions = [e.action for e in list_audit(session, target_id=first.id)]
    assert actions == ["invoice.create"]

    # New usage: the same draft (same id), recomputed.
    add_usage(db, tenant, NOV_1 + timedelta(days=2), prompt=5 * 10**6)
    updated = generate(db, tenant, NOV)
    assert (updated.id, updated.created_at) == (first.id, first.created_at)
    assert updated.total > first.total
    with session_scope(db) as session:
        actions = [e.action for e in list_audit(session, target_id=first.id)]
        assert actions == ["invoice.update", "invoice.create"]
        assert [v.id for v in list_invoices(session, tenant_id=tenant)] == [first.id]
        assert get_invoice(session, first.id) == updated


def test_late_usage_is_billed_once_in_the_next_open_month(db: sessionmaker[Session]) -> None:
    new_plan(db, variant(monthly_minimum="0"))
    tenant = new_tenant(db, "acme")
    on_time = add_usage(db, tenant, OCT_5, prompt=200_000, completion=50_000)
    october = finalize(db, generate(db, tenant, OCT).id)
    assert october.status == "final" and october.finalized_at is not None
    frozen = october.model_dump_json()

    # Arrives after October was finalised (a replayed spool, a slow replica).
    late = add_usage(db, tenant, OCT_5 + timedelta(days=20), prompt=300_000, cached=100_000,
                     completion=1_000)
    current = add_usage(db, tenant, NOV_1 + timedelta(days=1), prompt=10_000)
    assert generate(db, tenant, OCT).model_dump_json() == frozen
    assert finalize(db, october.id).model_dump_json() == frozen
    with session_scope(db) as session:
        got = get_invoice(session, october.id)
    assert got is not None and got.model_dump_json() == frozen

    november = generate(db, tenant, NOV)
    adjustments = [line for line in november.lines if line.kind == "adjustment"]
    assert {line.incurred_in for line in adjustments} == {OCT}
    assert november.adjustments == sum((line.amount for line in adjustments), Decimal(0))
    expected = build_invoice(
        tenant_id=tenant, period=NOV, plan=plan_of(db),
        usage=billable([(OCT_5 + timedelta(days=20), None, 300_000, 1_000, 100_000),
                        (NOV_1 + timedelta(days=1), None, 10_000, 500, 0)], NOV),
    )
    assert same_invoice(november, expected)
    assert_adds_up(november)

    final_november = finalize(db, november.id)
    assert final_november.model_dump(exclude={"status", "finalized_at"}) == november.model_dump(
        exclude={"status", "finalized_at"})
    # Each row names the one invoice that billed it.
    with session_scope(db) as session:
        stamped = dict(list(session.execute(select(UsageRecord.id, UsageRecord.invoice_id))))
    assert stamped == {on_time: october.id, late: november.id, current: november.id}

    # Later still, for October and for November: December bills both, once.
    add_usage(db, tenant, OCT_5, prompt=1_000_000, completion=0)
    add_usage(db, tenant, NOV_1, prompt=2_000_000, completion=0)
    december = generate(db, tenant, DEC)
    assert sorted(
        (line.incurred_in, line.quantity) for line in december.lines if line.kind == "adjustment"
    ) == [(OCT, Decimal(1)), (NOV, Decimal(2))]
    assert generate(db, tenant, NOV).model_dump_json() == final_november.model_dump_json()


def test_finalising_bills_what_is_there_then(db: sessionmaker[Session]) -> None:
    new_plan(db)
    tenant = new_tenant(db, "acme")
    draft = generate(db, tenant, OCT)
    add_usage(db, tenant, OCT_5, prompt=10**6)
    final = finalize(db, draft.id)
    assert final.id == draft.id and final.subtotal > draft.subtotal == 0
    assert_adds_up(final)


def test_errors(db: sessionmaker[Session]) -> None:
    new_plan(db)
    planless = new_tenant(db, "planless", plan=None)
    cases = [
        (dict(tenant_id="ten_nobody", period=NOV), 404, "No tenant with id 'ten_nobody'."),
        (dict(tenant_id=planless, period="2026-13"), 400, "Invalid value for 'period'"),
        (dict(tenant_id=planless, period="2026-1"), 400, "Invalid value for 'period'"),
        (dict(tenant_id=planless, period=NOV), 400, "has no price plan"),
    ]
    for kwargs, status, message in cases:
        with pytest.raises(ServiceError) as raised, session_scope(db) as session:
            generate_invoice(session, actor="test", request_id=None, **kwargs)
        assert service_error(raised.value).status_code == status
        assert message in raised.value.message
    with pytest.raises(ServiceError) as raised, session_scope(db) as session:
        finalize_invoice(session, "inv_nobody", actor="test", request_id=None)
    assert service_error(raised.value).status_code == 404


# ------------------------------------------------------------------------------ property

usage_rows = st.lists(
    st.tuples(
        st.integers(-3 * 24, 31 * 24 - 1),  # hours from November 1st: some in October
        st.sampled_from([None, "ad_a", OVERRIDDEN]),
        st.integers(0, 3_000_000),
        st.integers(0, 3_000_000),
        st.floats(0, 1),
    ),
    max_size=12,
)


@pytest.fixture(scope="module")
def sqlite_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sessionmaker[Session]]:
    path: Path = tmp_path_factory.mktemp("billing_property")
    with migrated_database("sqlite", path) as url:
        engine = make_engine(url)
        new_plan(session_factory(engine))
        yield session_factory(engine)
        engine.dispose()


def insert_rows(
    db: sessionmaker[Session], tenant: str, rows: list[tuple[int, str | None, int, int, float]]
) -> list[tuple[datetime, str | None, int, int, int]]:
    inserted = []
    for hours, adapter, prompt, completion, cached_share in rows:
        at = NOV_1 + timedelta(hours=hours)
        cached = int(prompt * cached_share)
        add_usage(db, tenant, at, adapter=adapter, prompt=prompt, completion=completion,
                  cached=cached)
        inserted.append((at, adapter, prompt, completion, cached))
    return inserted


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=usage_rows, late_rows=usage_rows)
def test_property_regenerating_is_identical_and_late_usage_moves_on(
    sqlite_db: sessionmaker[Session],
    rows: list[tuple[int, str | None, int, int, float]],
    late_rows: list[tuple[int, str | None, int, int, float]],
) -> None:
    db = sqlite_db
    tenant = new_tenant(db, new_id("t"))
    inserted = insert_rows(db, tenant, rows)
    billed = [row for row in inserted if period_of(row[0]) == NOV]
    first = generate(db, tenant, NOV)
    assert generate(db, tenant, NOV).model_dump_json() == first.model_dump_json()
    assert_adds_up(first)
    plan = plan_of(db)
    expected = build_invoice(tenant_id=tenant, period=NOV, plan=plan, usage=billable(billed, NOV))
    assert same_invoice(first, expected)

    final = finalize(db, first.id).model_dump_json()
    inserted += insert_rows(db, tenant, late_rows)
    assert generate(db, tenant, NOV).model_dump_json() == final
    # December bills its own rows and November's late ones; October's stay in October.
    december = generate(db, tenant, DEC)
    assert_adds_up(december)
    december_rows = [row for row in inserted if period_of(row[0]) == DEC]
    late = [row for row in inserted[len(rows):] if period_of(row[0]) == NOV]
    assert same_invoice(december, build_invoice(
        tenant_id=tenant, period=DEC, plan=plan, usage=billable([*december_rows, *late], DEC)))

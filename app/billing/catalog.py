"""Price plans in the database: create (immutable afterwards), list, look up; the plan a
tenant names must exist."""

from __future__ import annotations

from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.audit import record_audit
from app.billing import records
from app.billing.plans import PricePlan, TokenPrices, VolumeTier, minor_units
from app.core.errors import Conflict, InvalidInput
from app.tables import PlanRecord, Tenant, new_id
from app.tenants import conflict

# Plan names as tenants' `plan` field accepts them.
PLAN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"


class PlanCreate(PricePlan):
    """Body of POST /admin/plans; money as decimal strings (or ints), never floats."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=PLAN_NAME_PATTERN)

    # The plan's own checks across fields, repeated per field so that a refusal names
    # the field (`param`) instead of the whole body.
    @field_validator("monthly_minimum")
    @classmethod
    def _whole_minor_units(cls, value: Decimal, info: ValidationInfo) -> Decimal:
        currency = info.data.get("currency")
        exponent = value.as_tuple().exponent
        too_fine = isinstance(exponent, int) and exponent < -minor_units(str(currency))
        if isinstance(currency, str) and too_fine:
            raise ValueError(f"must be a whole number of {currency} minor units")
        return value

    @field_validator("volume_tiers")
    @classmethod
    def _increasing(cls, value: tuple[VolumeTier, ...]) -> tuple[VolumeTier, ...]:
        starts = [tier.from_tokens for tier in value]
        if starts != sorted(set(starts)):
            raise ValueError("from_tokens must be strictly increasing")
        return value


class PlanView(BaseModel):
    object: Literal["plan"] = "plan"
    name: str
    currency: str
    prompt_per_mtok: Decimal
    completion_per_mtok: Decimal
    cached_prompt_per_mtok: Decimal
    adapter_month: Decimal
    monthly_minimum: Decimal
    volume_tiers: list[VolumeTier]
    adapter_overrides: dict[str, TokenPrices]
    created_at: int  # unix seconds


def plan_view(row: PlanRecord) -> PlanView:
    plan = records.plan_from_record(row)
    return PlanView(
        name=plan.name,
        currency=plan.currency,
        prompt_per_mtok=plan.prompt_per_mtok,
        completion_per_mtok=plan.completion_per_mtok,
        cached_prompt_per_mtok=plan.cached_prompt_per_mtok,
        adapter_month=plan.adapter_month,
        monthly_minimum=plan.monthly_minimum,
        volume_tiers=list(plan.volume_tiers),
        adapter_overrides=dict(plan.adapter_overrides),
        created_at=int(row.created_at.timestamp()),
    )


def list_plans(session: Session) -> list[PlanView]:
    rows = session.scalars(select(PlanRecord).order_by(PlanRecord.name))
    return [plan_view(row) for row in rows]


def get_plan(session: Session, name: str) -> PlanView | None:
    row = records.plan_record(session, name)
    return None if row is None else plan_view(row)


def _plan_taken(name: str) -> Conflict:
    return conflict(f"A price plan named '{name}' already exists.", param="name")


def create_plan(
    session: Session, body: PlanCreate, *, actor: str, request_id: str | None
) -> PlanView:
    """Conflict on a duplicate name; the caller commits."""
    if records.plan_record(session, body.name) is not None:
        raise _plan_taken(body.name)
    money = body.model_dump(mode="json")
    row = PlanRecord(
        id=new_id("plan"),
        name=body.name,
        currency=body.currency,
        prompt_per_mtok=money["prompt_per_mtok"],
        completion_per_mtok=money["completion_per_mtok"],
        cached_prompt_per_mtok=money["cached_prompt_per_mtok"],
        adapter_month=money["adapter_month"],
        monthly_minimum=money["monthly_minimum"],
        volume_tiers=money["volume_tiers"],
        adapter_overrides=money["adapter_overrides"],
        created_by=actor,
    )
    session.add(row)
    try:
        session.flush()
    except IntegrityError:
        # Created concurrently under the same name.
        session.rollback()
        raise _plan_taken(body.name) from None
    record_audit(
        session, actor=actor, action="plan.create", target_type="plan", target_id=row.name,
        details=money, request_id=request_id,
    )
    return plan_view(row)


def require_plan(session: Session, name: str | None) -> None:
    """InvalidInput unless ``name`` (a tenant's `plan`) is None or names an existing plan."""
    if name is not None and records.plan_record(session, name) is None:
        raise InvalidInput(
            f"No price plan named '{name}'. Create it with POST /admin/plans first, "
            "or send null for no plan.",
            param="plan",
        )


def tenant_plan(session: Session, tenant: Tenant) -> PricePlan:
    if tenant.plan is None:
        raise InvalidInput(
            f"Tenant '{tenant.id}' has no price plan, so it cannot be invoiced. Give it one "
            f"with PATCH /admin/tenants/{tenant.id} {{\"plan\": \"<plan name>\"}}.",
            param="tenant_id",
        )
    row = records.plan_record(session, tenant.plan)
    if row is None:
        raise InvalidInput(
            f"Tenant '{tenant.id}' names the price plan '{tenant.plan}', which does not "
            "exist. Create it with POST /admin/plans or assign another plan.",
            param="tenant_id",
        )
    return records.plan_from_record(row)

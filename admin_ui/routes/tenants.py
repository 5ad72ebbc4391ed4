"""Tenants: the list, creating one, and editing its tier, isolation, plan and quotas.

The forms are checked by the admin API's own request models (TenantCreate, QuotasBody)
and written by app/tenants.py, so that the UI accepts exactly what the API accepts and
audits it the same way.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import ValidationError
from sqlalchemy.orm import Session

from admin_ui import forms
from admin_ui.deps import Authed, AuthedDep, CheckedForm
from admin_ui.web import PREFIX, render
from admin_ui.writes import by, commit
from app import tenants as crud
from app.api.deps import SessionDep
from app.api.errors import service_error, validation_error
from app.api.schemas.tenants import QuotasBody, TenantCreate
from app.api.state import AppStateDep
from app.billing import service as billing
from app.core.errors import ServiceError
from app.tables import Isolation, Tenant, Tier

router = APIRouter()

TIERS = [(t.value, t.value) for t in Tier]
ISOLATIONS = [(i.value, i.value) for i in Isolation]


def plan_options(session: Session) -> list[tuple[str, str]]:
    plans = billing.list_plans(session)
    return [("", "No plan")] + [(p.name, f"{p.name} ({p.currency})") for p in plans]


def _problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors()).message
    if isinstance(exc, ServiceError):
        return exc.message
    return str(exc)


def _status(exc: Exception) -> int:
    return service_error(exc).status_code if isinstance(exc, ServiceError) else 400


def _tenants_page(
    request: Request, authed: Authed, session: Session, *, values: dict[str, Any] | None = None,
    error: str | None = None, status_code: int = 200,
) -> HTMLResponse:
    blank: dict[str, Any] = {"name": "", "tier": Tier.STANDARD.value,
                             "isolation": Isolation.SHARED.value, "plan": ""}
    blank.update({name: None for name in crud.QUOTA_FIELDS})
    return render(request, "tenants.html", {
        "authed": authed, "active": "tenants", "title": "Tenants",
        "tenants": crud.list_tenants(session, include_deleted=False),
        "plans": plan_options(session), "tiers": TIERS, "isolations": ISOLATIONS,
        "values": {**blank, **(values or {})}, "error": error,
    }, status_code=status_code)


@router.get(PREFIX + "/tenants", response_class=HTMLResponse)
def tenants_page(request: Request, authed: AuthedDep, session: SessionDep) -> HTMLResponse:
    return _tenants_page(request, authed, session)


@router.post(PREFIX + "/tenants", response_class=HTMLResponse)
def create_tenant(
    request: Request, authed: AuthedDep, form: CheckedForm, session: SessionDep,
    state: AppStateDep,
) -> Response:
    values: dict[str, Any] = {name: forms.text(form, name)
                              for name in ("name", "tier", "isolation", "plan")}
    try:
        quotas = forms.quotas(form)
        values.update(quotas)
        body = TenantCreate(
            name=values["name"], tier=values["tier"], isolation=values["isolation"],
            quotas=QuotasBody(**quotas), plan=values["plan"] or None,
        )
        billing.require_plan(session, body.plan)
        row = crud.create_tenant(
            session, name=body.name, tier=body.tier, isolation=body.isolation,
            quotas=body.quotas.to_quotas(), plan=body.plan, by=by(request, authed),
        )
        commit(session, state)
    except (forms.FormProblem, ValidationError, ServiceError) as exc:
        session.rollback()
        return _tenants_page(request, authed, session, values=values, error=_problem(exc),
                             status_code=_status(exc))
    return RedirectResponse(f"{PREFIX}/tenants/{row.id}?created=1", status_code=303)


def _tenant_page(
    request: Request, authed: Authed, session: Session, row: Tenant, *,
    error: str | None = None, notice: str | None = None, status_code: int = 200,
) -> HTMLResponse:
    values: dict[str, Any] = {"tier": row.tier, "isolation": row.isolation,
                              "plan": row.plan or "", "disabled": row.disabled}
    values.update({name: getattr(row, name) for name in crud.QUOTA_FIELDS})
    return render(request, "tenant.html", {
        "authed": authed, "active": "tenants", "title": f"Tenant {row.name}",
        "tenant": row, "values": values, "plans": plan_options(session), "tiers": TIERS,
        "isolations": ISOLATIONS, "error": error, "notice": notice,
    }, status_code=status_code)


@router.get(PREFIX + "/tenants/{tenant_id}", response_class=HTMLResponse)
def tenant_page(
    tenant_id: str, request: Request, authed: AuthedDep, session: SessionDep,
    created: int = 0, saved: int = 0,
) -> HTMLResponse:
    row = crud.get_tenant(session, tenant_id=tenant_id, include_deleted=False)
    notice = "Tenant created." if created else "Changes saved." if saved else None
    return _tenant_page(request, authed, session, row, notice=notice)


@router.post(PREFIX + "/tenants/{tenant_id}", response_class=HTMLResponse)
def update_tenant(
    tenant_id: str, request: Request, authed: AuthedDep, form: CheckedForm,
    session: SessionDep, state: AppStateDep,
) -> Response:
    row = crud.get_tenant(session, tenant_id=tenant_id, include_deleted=False)
    try:
        quotas = QuotasBody(**forms.quotas(form))
        plan = forms.text(form, "plan") or None
        billing.require_plan(session, plan)
        patch = crud.TenantPatch(
            tier=Tier(forms.text(form, "tier")),
            isolation=Isolation(forms.text(form, "isolation")),
            plan=plan,
            disabled=forms.checked(form, "disabled"),
            quotas=quotas.model_dump(),
        )
        crud.update_tenant(session, tenant_id=tenant_id, patch=patch, by=by(request, authed))
        commit(session, state)
    except (forms.FormProblem, ValidationError, ServiceError, ValueError) as exc:
        session.rollback()
        row = crud.get_tenant(session, tenant_id=tenant_id, include_deleted=False)
        return _tenant_page(request, authed, session, row, error=_problem(exc),
                            status_code=_status(exc))
    return RedirectResponse(f"{PREFIX}/tenants/{row.id}?saved=1", status_code=303)

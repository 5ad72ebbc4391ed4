"""Admin routes for billing: price plans and invoices (JSON, CSV or a printable page).

Each write commits together with its audit row (app/billing/service.py writes both).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict

from app.api.deps import AdminPrincipal, SessionDep
from app.api.errors import APIError, invalid_request
from app.api.openapi import error_responses
from app.api.schemas.tenants import ListOf
from app.billing import service
from app.billing.render import csv_filename
from app.billing.service import InvoiceView, PlanCreate, PlanView
from app.tenants import get_tenant

router = APIRouter(prefix="/admin", tags=["billing"])


class InvoiceCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant_id: str
    period: str  # "YYYY-MM"


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


# -------------------------------------------------------------------------------- plans


@router.post(
    "/plans", status_code=201, response_model=PlanView, responses=error_responses(409)
)
def create_plan(
    body: PlanCreate, request: Request, principal: AdminPrincipal, session: SessionDep
) -> PlanView:
    view = service.create_plan(
        session, body, actor=principal.actor, request_id=_request_id(request)
    )
    session.commit()
    return view


@router.get("/plans", response_model=ListOf[PlanView])
def list_plans(principal: AdminPrincipal, session: SessionDep) -> ListOf[PlanView]:
    return ListOf[PlanView](data=service.list_plans(session))


@router.get("/plans/{name}", response_model=PlanView, responses=error_responses(404))
def get_plan(name: str, principal: AdminPrincipal, session: SessionDep) -> PlanView:
    view = service.get_plan(session, name)
    if view is None:
        raise APIError(404, f"No price plan named '{name}'.", code="not_found")
    return view


# ----------------------------------------------------------------------------- invoices


@router.post("/invoices", response_model=InvoiceView, responses=error_responses(404))
def generate_invoice(
    body: InvoiceCreate, request: Request, principal: AdminPrincipal, session: SessionDep
) -> InvoiceView:
    """Create the tenant's invoice for the period, or recompute its draft; a final
    invoice comes back as it is. Idempotent: the same id for the same tenant and period."""
    view = service.generate_invoice(
        session,
        tenant_id=body.tenant_id,
        period=body.period,
        actor=principal.actor,
        request_id=_request_id(request),
    )
    session.commit()
    return view


@router.get("/invoices", response_model=ListOf[InvoiceView], responses=error_responses(404))
def list_invoices(
    principal: AdminPrincipal, session: SessionDep, tenant_id: str | None = None
) -> ListOf[InvoiceView]:
    if tenant_id is not None:
        get_tenant(session, tenant_id=tenant_id)  # 404 for an unknown tenant
    return ListOf[InvoiceView](data=service.list_invoices(session, tenant_id=tenant_id))


@router.get(
    "/invoices/{invoice_id}",
    response_model=InvoiceView,
    responses={
        200: {"content": {"text/csv": {"schema": {"type": "string"}},
                          "text/html": {"schema": {"type": "string"}}},
              "description": "JSON, CSV or a printable HTML page"},
        **error_responses(400, 404),
    },
)
def get_invoice(
    invoice_id: str,
    principal: AdminPrincipal,
    session: SessionDep,
    format_: Annotated[str | None, Query(alias="format")] = None,
) -> InvoiceView | Response:
    if format_ not in (None, "json", "csv", "html"):
        raise invalid_request(
            f"Invalid value for 'format': expected json, csv or html, got '{format_}'.",
            param="format",
        )
    view = service.get_invoice(session, invoice_id)
    if view is None:
        raise APIError(404, f"No invoice with id '{invoice_id}'.", code="not_found")
    if format_ == "csv":
        return Response(
            service.invoice_csv(view),
            media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{csv_filename(view)}"'},
        )
    if format_ == "html":
        return Response(service.invoice_html(view), media_type="text/html; charset=utf-8")
    return view


@router.post(
    "/invoices/{invoice_id}/finalize",
    response_model=InvoiceView,
    responses=error_responses(400, 404),
)
def finalize_invoice(
    invoice_id: str, request: Request, principal: AdminPrincipal, session: SessionDep
) -> InvoiceView:
    """Freeze the invoice; late usage for its month goes to the next open month."""
    view = service.finalize_invoice(
        session, invoice_id, actor=principal.actor, request_id=_request_id(request)
    )
    session.commit()
    return view

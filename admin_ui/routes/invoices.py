"""Invoices: generate one for a tenant and month, list them, view one, download it as
CSV or JSON, open its printable page, finalize it (all through app/billing/service.py)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy.orm import Session

from admin_ui import forms
from admin_ui.deps import Authed, AuthedDep, CheckedForm
from admin_ui.web import PREFIX, UIError, render
from admin_ui.writes import by
from app import tenants as crud
from app.api.deps import SessionDep
from app.api.errors import service_error
from app.billing import service as billing
from app.billing.service import InvoiceView
from app.core.errors import ServiceError
from app.tables import utcnow

router = APIRouter()

# The printable invoice is the billing service's own standalone page, styles inline.
PRINT_CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
             "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def _invoice(session: Session, invoice_id: str) -> InvoiceView:
    view = billing.get_invoice(session, invoice_id)
    if view is None:
        raise UIError(404, f"No invoice with id '{invoice_id}'.", title="Not found")
    return view


def _list_page(
    request: Request, authed: Authed, session: Session, *, tenant_id: str | None,
    period: str | None = None, error: str | None = None, status_code: int = 200,
) -> HTMLResponse:
    tenants = crud.list_tenants(session, include_deleted=True)
    return render(request, "invoices.html", {
        "authed": authed, "active": "invoices", "title": "Invoices",
        "tenants": [(t.id, t.name) for t in tenants if t.deleted_at is None],
        "names": {t.id: t.name for t in tenants},
        "invoices": billing.list_invoices(session, tenant_id=tenant_id or None),
        "tenant_id": tenant_id or "", "period": period or utcnow().strftime("%Y-%m"),
        "error": error,
    }, status_code=status_code)


@router.get(PREFIX + "/invoices", response_class=HTMLResponse)
def invoices_page(request: Request, authed: AuthedDep, session: SessionDep,
                  tenant_id: str | None = None) -> HTMLResponse:
    return _list_page(request, authed, session, tenant_id=tenant_id)


@router.post(PREFIX + "/invoices", response_class=HTMLResponse)
def generate(request: Request, authed: AuthedDep, form: CheckedForm, session: SessionDep
             ) -> Response:
    tenant_id, period = forms.text(form, "tenant_id"), forms.text(form, "period")
    if not tenant_id:
        return _list_page(request, authed, session, tenant_id=None, period=period,
                          error="Choose a tenant.", status_code=400)
    context = by(request, authed)
    try:
        view = billing.generate_invoice(
            session, tenant_id=tenant_id, period=period, actor=context.actor,
            request_id=context.request_id,
        )
        session.commit()
    except ServiceError as exc:
        session.rollback()
        return _list_page(request, authed, session, tenant_id=tenant_id, period=period,
                          error=exc.message, status_code=service_error(exc).status_code)
    return RedirectResponse(f"{PREFIX}/invoices/{view.id}", status_code=303)


@router.get(PREFIX + "/invoices/{invoice_id}", response_class=HTMLResponse)
def invoice_page(invoice_id: str, request: Request, authed: AuthedDep, session: SessionDep,
                 finalized: int = 0) -> HTMLResponse:
    view = _invoice(session, invoice_id)
    tenant = crud.get_tenant(session, tenant_id=view.tenant_id)
    return render(request, "invoice.html", {
        "authed": authed, "active": "invoices", "title": f"Invoice {view.period}",
        "invoice": view, "tenant": tenant,
        "notice": "Invoice finalized." if finalized else None,
    })


@router.get(PREFIX + "/invoices/{invoice_id}/print", response_class=HTMLResponse)
def invoice_print(invoice_id: str, authed: AuthedDep, session: SessionDep) -> HTMLResponse:
    view = _invoice(session, invoice_id)
    return HTMLResponse(billing.invoice_html(view), headers={
        "Content-Security-Policy": PRINT_CSP, "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-store",
    })


@router.get(PREFIX + "/invoices/{invoice_id}/download")
def invoice_download(invoice_id: str, authed: AuthedDep, session: SessionDep,
                     format: Literal["csv", "json"] = "csv") -> Response:
    view = _invoice(session, invoice_id)
    filename = f"invoice-{view.period}-{view.id}.{format}"
    if format == "csv":
        body, media_type = billing.invoice_csv(view), "text/csv; charset=utf-8"
    else:
        body, media_type = view.model_dump_json(indent=2), "application/json"
    return Response(body, media_type=media_type, headers={
        "Content-Disposition": f'attachment; filename="{filename}"', "Cache-Control": "no-store",
    })


@router.post(PREFIX + "/invoices/{invoice_id}/finalize")
def finalize(invoice_id: str, request: Request, authed: AuthedDep, form: CheckedForm,
             session: SessionDep) -> Response:
    context = by(request, authed)
    billing.finalize_invoice(session, invoice_id, actor=context.actor,
                             request_id=context.request_id)
    session.commit()
    return RedirectResponse(f"{PREFIX}/invoices/{invoice_id}?finalized=1", status_code=303)

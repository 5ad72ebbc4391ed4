"""A tenant's API keys: the list, a new key (its secret shown once, on the response to
the form, never in a URL or a log), and revoking one."""

from __future__ import annotations

from datetime import UTC, datetime, time

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import ValidationError
from sqlalchemy.orm import Session

from admin_ui import forms
from admin_ui.deps import Authed, AuthedDep, CheckedForm
from admin_ui.web import PREFIX, UIError, render
from admin_ui.writes import by, commit
from app import tenants as crud
from app.api.deps import SessionDep
from app.api.errors import service_error, validation_error
from app.api.schemas.tenants import TenantKeyCreate
from app.api.state import AppStateDep
from app.core.errors import ServiceError
from app.tables import Scope

router = APIRouter()

SCOPES = [(s.value, s.value) for s in Scope]


def _keys_page(
    request: Request, authed: Authed, session: Session, tenant_id: str, *,
    created_key: str | None = None, created_name: str | None = None, error: str | None = None,
    notice: str | None = None, status_code: int = 200,
) -> HTMLResponse:
    tenant = crud.get_tenant(session, tenant_id=tenant_id, include_deleted=False)
    return render(request, "keys.html", {
        "authed": authed, "active": "tenants", "title": f"API keys of {tenant.name}",
        "tenant": tenant, "keys": crud.list_tenant_keys(session, tenant_id=tenant_id),
        "scopes": SCOPES, "created_key": created_key, "created_name": created_name,
        "error": error, "notice": notice,
    }, status_code=status_code)


@router.get(PREFIX + "/tenants/{tenant_id}/keys", response_class=HTMLResponse)
def keys_page(tenant_id: str, request: Request, authed: AuthedDep, session: SessionDep,
              revoked: str | None = None) -> HTMLResponse:
    notice = f"Key {revoked} revoked." if revoked else None
    return _keys_page(request, authed, session, tenant_id, notice=notice)


@router.post(PREFIX + "/tenants/{tenant_id}/keys", response_class=HTMLResponse)
def create_key(
    tenant_id: str, request: Request, authed: AuthedDep, form: CheckedForm,
    session: SessionDep, state: AppStateDep,
) -> HTMLResponse:
    try:
        expires = forms.text(form, "expires_on")
        body = TenantKeyCreate(
            name=forms.text(form, "name"),
            scopes=[Scope(s) for s in form.getlist("scopes") if isinstance(s, str)] or None,
            # A date: the key works until that day ends (UTC).
            expires_at=datetime.combine(
                datetime.strptime(expires, "%Y-%m-%d").date(), time.max, UTC
            ) if expires else None,
        )
        created = crud.create_tenant_key(
            session, secret=state.directory.secret, tenant_id=tenant_id, name=body.name,
            scopes=body.scopes if body.scopes is not None else crud.DEFAULT_SCOPES,
            expires_at=body.expires_at, by=by(request, authed),
        )
        commit(session, state)
    except (ValidationError, ServiceError, ValueError) as exc:
        session.rollback()
        message = (validation_error(exc.errors()).message if isinstance(exc, ValidationError)
                   else exc.message if isinstance(exc, ServiceError)
                   else f"Invalid value: {exc}.")
        status = service_error(exc).status_code if isinstance(exc, ServiceError) else 400
        return _keys_page(request, authed, session, tenant_id, error=message,
                          status_code=status)
    # NOTE: rendered, not redirected: the key exists only in this response.
    return _keys_page(
        request, authed, session, tenant_id, created_key=created.key,
        created_name=created.row.name,
        notice=f"Key '{created.row.name}' created. Copy it now: it is not shown again.",
    )


@router.post(PREFIX + "/keys/{key_id}/revoke")
def revoke_key(
    key_id: str, request: Request, authed: AuthedDep, form: CheckedForm, session: SessionDep,
    state: AppStateDep,
) -> Response:
    row = crud.get_key(session, key_id=key_id)
    if row.tenant_id is None:
        raise UIError(400, "Admin keys are revoked through the admin API (DELETE /admin/keys/"
                           "{id}), not from a tenant's page.")
    crud.revoke_key(session, key_id=key_id, by=by(request, authed))
    commit(session, state)
    return RedirectResponse(
        f"{PREFIX}/tenants/{row.tenant_id}/keys?revoked={row.prefix}", status_code=303
    )

"""Admin routes: tenants, their API keys, admin keys and the audit log.

Sync routes (FastAPI runs them in its thread pool) on a session per request; each write
commits together with its audit row, then refreshes this replica's Directory so that
the change takes effect here at once (other replicas see it on their next refresh).
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app import tenants as crud
from app.api.deps import AdminPrincipal, SessionDep, audit_context
from app.api.errors import invalid_request
from app.api.openapi import error_responses
from app.api.schemas.tenants import (
    AdminKeyCreate,
    AuditOut,
    CreatedKeyOut,
    KeyOut,
    ListOf,
    TenantCreate,
    TenantKeyCreate,
    TenantOut,
    TenantUpdate,
)
from app.api.state import AppStateDep
from app.audit import list_audit
from app.billing.service import require_plan

router = APIRouter(prefix="/admin", tags=["admin"])

MAX_AUDIT_LIMIT = 1000
# PATCH fields that have no "unset" value: null is refused rather than guessed at.
_NOT_NULLABLE = ("name", "tier", "isolation", "disabled", "quotas")


# ----------------------------------------------------------------------------- tenants


@router.post(
    "/tenants", status_code=201, response_model=TenantOut, responses=error_responses(409)
)
def create_tenant(
    body: TenantCreate,
    request: Request,
    principal: AdminPrincipal,
    session: SessionDep,
    state: AppStateDep,
) -> TenantOut:
    require_plan(session, body.plan)
    row = crud.create_tenant(
        session,
        name=body.name,
        tier=body.tier,
        isolation=body.isolation,
        quotas=body.quotas.to_quotas(),
        plan=body.plan,
        by=audit_context(request, principal),
    )
    session.commit()
    state.directory.refresh_after_write()
    return TenantOut.of(row)


@router.get("/tenants", response_model=ListOf[TenantOut])
def list_tenants(
    principal: AdminPrincipal, session: SessionDep, include_deleted: bool = False
) -> ListOf[TenantOut]:
    rows = crud.list_tenants(session, include_deleted=include_deleted)
    return ListOf[TenantOut](data=[TenantOut.of(r) for r in rows])


@router.get("/tenants/{tenant_id}", response_model=TenantOut, responses=error_responses(404))
def get_tenant(tenant_id: str, principal: AdminPrincipal, session: SessionDep) -> TenantOut:
    return TenantOut.of(crud.get_tenant(session, tenant_id=tenant_id))


@router.patch(
    "/tenants/{tenant_id}", response_model=TenantOut, responses=error_responses(404, 409)
)
def update_tenant(
    tenant_id: str,
    body: TenantUpdate,
    request: Request,
    principal: AdminPrincipal,
    session: SessionDep,
    state: AppStateDep,
) -> TenantOut:
    sent = body.model_fields_set
    for name in _NOT_NULLABLE:
        if name in sent and getattr(body, name) is None:
            raise invalid_request(f"'{name}' cannot be null; omit it to keep it.", param=name)
    if "plan" in sent:
        require_plan(session, body.plan)
    patch = crud.TenantPatch(
        **{name: getattr(body, name) for name in sent if name != "quotas"},
        quotas=body.quotas.set_fields() if body.quotas is not None else {},
    )
    row = crud.update_tenant(
        session, tenant_id=tenant_id, patch=patch, by=audit_context(request, principal)
    )
    session.commit()
    state.directory.refresh_after_write()
    return TenantOut.of(row)


@router.delete(
    "/tenants/{tenant_id}",
    status_code=204,
    response_class=Response,
    responses=error_responses(404),
)
def delete_tenant(
    tenant_id: str,
    request: Request,
    principal: AdminPrincipal,
    session: SessionDep,
    state: AppStateDep,
) -> Response:
    crud.delete_tenant(session, tenant_id=tenant_id, by=audit_context(request, principal))
    session.commit()
    state.directory.refresh_after_write()
    return Response(status_code=204)


# -------------------------------------------------------------------------------- keys


@router.post(
    "/tenants/{tenant_id}/keys",
    status_code=201,
    response_model=CreatedKeyOut,
    responses=error_responses(404),
)
def create_tenant_key(
    tenant_id: str,
    body: TenantKeyCreate,
    request: Request,
    principal: AdminPrincipal,
    session: SessionDep,
    state: AppStateDep,
) -> CreatedKeyOut:
    created = crud.create_tenant_key(
        session,
        secret=state.directory.secret,
        tenant_id=tenant_id,
        name=body.name,
        scopes=body.scopes if body.scopes is not None else crud.DEFAULT_SCOPES,
        expires_at=body.expires_at,
        by=audit_context(request, principal),
    )
    session.commit()
    state.directory.refresh_after_write()
    return CreatedKeyOut(**KeyOut.fields_of(created.row), key=created.key)


@router.get(
    "/tenants/{tenant_id}/keys", response_model=ListOf[KeyOut], responses=error_responses(404)
)
def list_tenant_keys(
    tenant_id: str, principal: AdminPrincipal, session: SessionDep
) -> ListOf[KeyOut]:
    rows = crud.list_tenant_keys(session, tenant_id=tenant_id)
    return ListOf[KeyOut](data=[KeyOut.of(r) for r in rows])


@router.post("/keys", status_code=201, response_model=CreatedKeyOut)
def create_admin_key(
    body: AdminKeyCreate,
    request: Request,
    principal: AdminPrincipal,
    session: SessionDep,
    state: AppStateDep,
) -> CreatedKeyOut:
    created = crud.create_admin_key(
        session,
        secret=state.directory.secret,
        name=body.name,
        expires_at=body.expires_at,
        by=audit_context(request, principal),
    )
    session.commit()
    state.directory.refresh_after_write()
    return CreatedKeyOut(**KeyOut.fields_of(created.row), key=created.key)


@router.get("/keys", response_model=ListOf[KeyOut])
def list_admin_keys(principal: AdminPrincipal, session: SessionDep) -> ListOf[KeyOut]:
    return ListOf[KeyOut](data=[KeyOut.of(r) for r in crud.list_admin_keys(session)])


@router.delete(
    "/keys/{key_id}", status_code=204, response_class=Response, responses=error_responses(404)
)
def revoke_key(
    key_id: str,
    request: Request,
    principal: AdminPrincipal,
    session: SessionDep,
    state: AppStateDep,
) -> Response:
    crud.revoke_key(session, key_id=key_id, by=audit_context(request, principal))
    session.commit()
    state.directory.refresh_after_write()
    return Response(status_code=204)


# ------------------------------------------------------------------------------- audit


@router.get("/audit", response_model=ListOf[AuditOut])
def audit_log(
    principal: AdminPrincipal,
    session: SessionDep,
    limit: int = 100,
    target_id: str | None = None,
    actor: str | None = None,
    action: str | None = None,
) -> ListOf[AuditOut]:
    """Newest first."""
    if not 1 <= limit <= MAX_AUDIT_LIMIT:
        raise invalid_request(
            f"'limit' must be between 1 and {MAX_AUDIT_LIMIT}, got {limit}.", param="limit"
        )
    rows = list_audit(session, limit=limit, target_id=target_id, actor=actor, action=action)
    return ListOf[AuditOut](data=[AuditOut.of(r) for r in rows])

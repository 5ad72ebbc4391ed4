"""Route dependencies: the caller (from its bearer key), scopes, database sessions.

NOTE: the dependencies that only read memory are `async def`: FastAPI runs a plain `def`
dependency in its thread pool, and three thread hops per request cost about a quarter
of the gateway's CPU per request (bench/gateway/run.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from app.api.errors import APIError
from app.api.state import AppStateDep
from app.audit import AuditContext
from app.core.principal import LOCAL_PRINCIPAL, Principal
from app.tables import Scope


async def get_principal(request: Request, state: AppStateDep) -> Principal:
    """The caller; 401 `invalid_api_key` for a missing, malformed, unknown, expired or
    revoked key. Without auth (--no-auth, loopback only) everyone is the local admin."""
    if state.settings.no_auth:
        principal = LOCAL_PRINCIPAL
    else:
        principal = state.directory.authenticate(request.headers.get("authorization"))
    request.state.principal = principal
    return principal


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


def forbidden(message: str) -> APIError:
    return APIError(403, message, code="permission_denied")


async def get_admin(principal: CurrentPrincipal) -> Principal:
    if not principal.is_admin:
        raise forbidden("This route needs an admin key; tenant keys cannot use it.")
    return principal


AdminPrincipal = Annotated[Principal, Depends(get_admin)]


def require_scope(scope: Scope) -> object:
    """A dependency: 403 unless the caller's key has `scope` (admin keys have all)."""

    async def check(principal: CurrentPrincipal) -> Principal:
        if not principal.has_scope(scope):
            raise forbidden(f"This key lacks the '{scope.value}' scope.")
        return principal

    return Depends(check)


async def get_inference_caller(principal: CurrentPrincipal) -> Principal:
    if not principal.has_scope(Scope.INFERENCE):
        raise forbidden(f"This key lacks the '{Scope.INFERENCE.value}' scope.")
    return principal


InferencePrincipal = Annotated[Principal, Depends(get_inference_caller)]

# An admin names the tenant it acts for on the generation routes and /v1/models.
ACT_FOR_TENANT_HEADER = "X-Loraplex-Tenant"


async def get_serving_caller(
    request: Request, state: AppStateDep, principal: InferencePrincipal
) -> Principal:
    """The caller of a generation or model-list route: with `X-Loraplex-Tenant: <tenant
    id>`, an admin acting for that tenant (its own and the shared adapters).

    NOTE: a tenant key that sends the header is refused, even naming its own tenant: a
    header that some keys may send and others not is a probe nobody needs. A disabled
    tenant may still be acted for, so that an admin can try its adapters before
    enabling it; a deleted one is gone (404).
    """
    value = request.headers.get(ACT_FOR_TENANT_HEADER)
    if value is None:
        return principal
    if not principal.is_admin:
        raise forbidden(
            f"The {ACT_FOR_TENANT_HEADER} header needs an admin key; tenant keys always "
            "act for their own tenant."
        )
    tenant_id = value.strip()
    tenant = state.directory.tenant(tenant_id) if tenant_id else None
    if tenant is None:
        raise APIError(
            404,
            f"No tenant has the id '{tenant_id}' (from the {ACT_FOR_TENANT_HEADER} header); "
            "it takes a tenant's id, as GET /admin/tenants lists them, not its name.",
            code="tenant_not_found",
        )
    acting = replace(principal, acting_for=tenant)
    request.state.principal = acting
    return acting


ServingPrincipal = Annotated[Principal, Depends(get_serving_caller)]


def get_session(state: AppStateDep) -> Iterator[Session]:
    """A session per request; routes commit what they change."""
    session = state.db()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]


def audit_context(request: Request, principal: Principal) -> AuditContext:
    """Who acts in an audited change a route makes, and for which request."""
    return AuditContext(
        actor=principal.actor, request_id=getattr(request.state, "request_id", None)
    )

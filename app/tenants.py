"""Tenants and API keys in the database: create, read, update, soft-delete, revoke.

Every change is audited in the caller's transaction; the caller commits (and then asks
the Directory to refresh, so that its own replica sees the change at once).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import CursorResult, Result, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.audit import AuditContext, audit
from app.core.errors import Conflict, InvalidInput, NotFound
from app.core.principal import Quotas
from app.core.security import generate_key
from app.tables import Adapter, ApiKey, Isolation, Scope, Tenant, Tier, new_id, utcnow

QUOTA_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Quotas))
DEFAULT_SCOPES: tuple[Scope, ...] = (Scope.INFERENCE,)
ALL_SCOPES: tuple[str, ...] = tuple(s.value for s in Scope)


class _Unset(enum.Enum):
    UNSET = "unset"


UNSET = _Unset.UNSET


@dataclass(frozen=True, slots=True)
class TenantPatch:
    """A partial update: fields left UNSET keep their value."""

    name: str | _Unset = UNSET
    tier: Tier | _Unset = UNSET
    isolation: Isolation | _Unset = UNSET
    plan: str | _Unset | None = UNSET
    disabled: bool | _Unset = UNSET
    # Only the quotas to change; None makes one unlimited.
    quotas: Mapping[str, int | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CreatedKey:
    row: ApiKey
    key: str  # the plaintext key: returned once, never stored


# ------------------------------------------------------------------------------ errors


def not_found(kind: str, ident: str) -> NotFound:
    return NotFound(f"No {kind} with id '{ident}'.")


def conflict(message: str, *, param: str | None = None) -> Conflict:
    return Conflict(message, param=param)


# ----------------------------------------------------------------------------- tenants


def tenant_quotas(row: Tenant) -> Quotas:
    return Quotas(**{name: getattr(row, name) for name in QUOTA_FIELDS})


def _name_taken(name: str) -> Conflict:
    # NOTE: a deleted tenant keeps its name (its usage rows and invoices still carry it).
    return conflict(f"A tenant named '{name}' already exists (or existed).", param="name")


def _flush_unique_name(session: Session, name: str) -> None:
    """Flush; a concurrent insert of the same name surfaces as a Conflict, not a crash."""
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise _name_taken(name) from None


def create_tenant(
    session: Session,
    *,
    name: str,
    tier: Tier = Tier.STANDARD,
    isolation: Isolation = Isolation.SHARED,
    quotas: Quotas | None = None,
    plan: str | None = None,
    by: AuditContext,
) -> Tenant:
    quotas = quotas or Quotas()
    if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise _name_taken(name)
    row = Tenant(
        id=new_id("ten"),
        name=name,
        tier=tier.value,
        isolation=isolation.value,
        plan=plan,
        disabled=False,
        **dataclasses.asdict(quotas),
    )
    session.add(row)
    _flush_unique_name(session, name)
    audit(
        session,
        by,
        "tenant.create",
        target_type="tenant",
        target_id=row.id,
        details={
            "name": name,
            "tier": tier.value,
            "isolation": isolation.value,
            "plan": plan,
            "quotas": dataclasses.asdict(quotas),
        },
    )
    return row


def get_tenant(session: Session, *, tenant_id: str, include_deleted: bool = True) -> Tenant:
    row = session.get(Tenant, tenant_id)
    if row is None or (row.deleted_at is not None and not include_deleted):
        raise not_found("tenant", tenant_id)
    return row


def list_tenants(session: Session, *, include_deleted: bool = False) -> Sequence[Tenant]:
    query = select(Tenant).order_by(Tenant.created_at, Tenant.id)
    if not include_deleted:
        query = query.where(Tenant.deleted_at.is_(None))
    return session.scalars(query).all()


def update_tenant(
    session: Session, *, tenant_id: str, patch: TenantPatch, by: AuditContext
) -> Tenant:
    """Apply `patch`; the audit row lists each changed field as [old, new]."""
    row = get_tenant(session, tenant_id=tenant_id, include_deleted=False)
    new_values: dict[str, Any] = {}
    if not isinstance(patch.name, _Unset):
        if patch.name != row.name and session.scalar(
            select(Tenant.id).where(Tenant.name == patch.name)
        ) is not None:
            raise _name_taken(patch.name)
        new_values["name"] = patch.name
    if not isinstance(patch.tier, _Unset):
        new_values["tier"] = patch.tier.value
    if not isinstance(patch.isolation, _Unset):
        new_values["isolation"] = patch.isolation.value
    if not isinstance(patch.plan, _Unset):
        new_values["plan"] = patch.plan
    if not isinstance(patch.disabled, _Unset):
        new_values["disabled"] = patch.disabled
    for name, value in patch.quotas.items():
        assert name in QUOTA_FIELDS, f"unknown quota {name!r}"
        new_values[name] = value
    changes = {
        name: [getattr(row, name), value]
        for name, value in new_values.items()
        if getattr(row, name) != value
    }
    if not changes:
        return row
    for name, (_, value) in changes.items():
        setattr(row, name, value)
    if "name" in changes:
        _flush_unique_name(session, row.name)
    audit(
        session,
        by,
        "tenant.update",
        target_type="tenant",
        target_id=row.id,
        details={"changes": changes},
    )
    return row


def _rowcount(result: Result[Any]) -> int:
    assert isinstance(result, CursorResult), "an UPDATE statement returns a cursor result"
    return result.rowcount


def delete_tenant(session: Session, *, tenant_id: str, by: AuditContext) -> Tenant:
    """Soft delete: the row stays (usage rows and invoices refer to it), its keys are
    revoked and its adapters deleted, so that nothing of it serves any more."""
    row = get_tenant(session, tenant_id=tenant_id, include_deleted=False)
    now = utcnow()
    row.deleted_at = now
    row.disabled = True
    revoked = _rowcount(session.execute(
        update(ApiKey)
        .where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now, updated_at=now)
    ))
    deleted_adapters = _rowcount(session.execute(
        update(Adapter)
        .where(Adapter.tenant_id == tenant_id, Adapter.deleted_at.is_(None))
        .values(deleted_at=now, updated_at=now)
    ))
    audit(
        session,
        by,
        "tenant.delete",
        target_type="tenant",
        target_id=row.id,
        details={"name": row.name, "revoked_keys": revoked, "deleted_adapters": deleted_adapters},
    )
    return row


# -------------------------------------------------------------------------------- keys


def _check_expiry(expires_at: datetime | None) -> None:
    if expires_at is not None and expires_at <= utcnow():
        raise InvalidInput(
            f"'expires_at' must be in the future (got {expires_at.isoformat()}).",
            param="expires_at",
        )


def _new_key(
    session: Session,
    *,
    secret: str,
    tenant_id: str | None,
    name: str,
    scopes: list[str],
    expires_at: datetime | None,
    by: AuditContext,
) -> CreatedKey:
    _check_expiry(expires_at)
    is_admin = tenant_id is None
    new = generate_key("a" if is_admin else "t", secret)
    row = ApiKey(
        id=new_id("key"),
        tenant_id=tenant_id,
        is_admin=is_admin,
        name=name,
        prefix=new.prefix,
        key_hash=new.key_hash,
        scopes=scopes,
        expires_at=expires_at,
        created_by=by.actor,
    )
    session.add(row)
    session.flush()
    audit(
        session,
        by,
        "key.create",
        target_type="api_key",
        target_id=row.id,
        details={
            "tenant_id": tenant_id,
            "is_admin": is_admin,
            "name": name,
            "prefix": new.prefix,
            "scopes": scopes,
            "expires_at": None if expires_at is None else expires_at.isoformat(),
        },
    )
    return CreatedKey(row=row, key=new.key)


def create_tenant_key(
    session: Session,
    *,
    secret: str,
    tenant_id: str,
    name: str,
    scopes: Sequence[Scope] = DEFAULT_SCOPES,
    expires_at: datetime | None = None,
    by: AuditContext,
) -> CreatedKey:
    get_tenant(session, tenant_id=tenant_id, include_deleted=False)
    if not scopes:
        raise InvalidInput("'scopes' must name at least one scope.", param="scopes")
    unique = list(dict.fromkeys(Scope(s).value for s in scopes))
    return _new_key(
        session,
        secret=secret,
        tenant_id=tenant_id,
        name=name,
        scopes=unique,
        expires_at=expires_at,
        by=by,
    )


def create_admin_key(
    session: Session,
    *,
    secret: str,
    name: str,
    expires_at: datetime | None = None,
    by: AuditContext,
) -> CreatedKey:
    return _new_key(
        session,
        secret=secret,
        tenant_id=None,
        name=name,
        scopes=list(ALL_SCOPES),
        expires_at=expires_at,
        by=by,
    )


def list_tenant_keys(session: Session, *, tenant_id: str) -> Sequence[ApiKey]:
    get_tenant(session, tenant_id=tenant_id)
    query = select(ApiKey).where(ApiKey.tenant_id == tenant_id)
    return session.scalars(query.order_by(ApiKey.created_at, ApiKey.id)).all()


def list_admin_keys(session: Session) -> Sequence[ApiKey]:
    query = select(ApiKey).where(ApiKey.is_admin.is_(True))
    return session.scalars(query.order_by(ApiKey.created_at, ApiKey.id)).all()


def get_key(session: Session, *, key_id: str) -> ApiKey:
    row = session.get(ApiKey, key_id)
    if row is None:
        raise not_found("API key", key_id)
    return row


def revoke_key(session: Session, *, key_id: str, by: AuditContext) -> ApiKey:
    """Revoke a tenant's or an admin's key; revoking it again changes nothing."""
    row = get_key(session, key_id=key_id)
    if row.revoked_at is not None:
        return row
    row.revoked_at = utcnow()
    audit(
        session,
        by,
        "key.revoke",
        target_type="api_key",
        target_id=row.id,
        details={"tenant_id": row.tenant_id, "is_admin": row.is_admin, "prefix": row.prefix},
    )
    return row

"""The registry's rows: adapters (a name per owner) and their numbered versions.

Functions take the caller's session; changes are audited in the same transaction.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session, selectinload

from app.audit import AuditContext, audit
from app.core.errors import Conflict, Forbidden
from app.registry.archive import UnpackedAdapter
from app.registry.views import (
    SHARED_OWNER,
    AdapterView,
    VersionView,
    adapter_not_found,
    adapter_view,
    tenant_not_found,
    version_view,
)
from app.tables import Adapter, AdapterStatus, AdapterVersion, Tenant, new_id, utcnow

# Versions whose files must stay on disk.
LIVE_STATUSES = (AdapterStatus.VALIDATING.value, AdapterStatus.READY.value)


def live_tenant(s: Session, tenant_id: str, *, lock: bool = False) -> Tenant:
    tenant = s.get(Tenant, tenant_id, with_for_update=lock)
    if tenant is None or tenant.deleted_at is not None:
        raise tenant_not_found(tenant_id)
    return tenant


def check_quota(s: Session, tenant: Tenant, name: str) -> None:
    """max_adapters counts the tenant's names with a validating or ready version: a new
    version of one of them is free, a name whose uploads all failed does not count.
    Over the limit: Forbidden `max_adapters_exceeded`."""
    limit = tenant.max_adapters
    if limit is None:
        return
    live = select(AdapterVersion.adapter_id).where(AdapterVersion.status.in_(LIVE_STATUSES))
    names = set(s.scalars(
        select(Adapter.name).where(
            Adapter.owner == tenant.id, Adapter.deleted_at.is_(None), Adapter.id.in_(live)
        )
    ))
    if name in names or len(names) < limit:
        return
    raise Forbidden(
        f"This tenant has {len(names)} adapters and its limit (max_adapters) is {limit}: "
        "delete one, or upload a new version of an existing name.",
        code="max_adapters_exceeded",
    )


def insert_version(
    s: Session,
    unpacked: UnpackedAdapter,
    *,
    name: str,
    tenant_id: str | None,
    by: AuditContext,
    enforce_quota: bool,
    stage: bool = False,
) -> VersionView:
    """The next version of (owner, name), `validating`; creates (or revives) the adapter.
    Staged (not what plain `name` resolves to once ready) when `stage` asks for it or the
    adapter has a promotion gate."""
    owner = SHARED_OWNER if tenant_id is None else tenant_id
    if tenant_id is not None:
        # The tenant row's lock serializes its uploads (PostgreSQL), so that two new
        # names cannot both pass the quota.
        tenant = live_tenant(s, tenant_id, lock=True)
        if enforce_quota:
            check_quota(s, tenant, name)
    adapter = s.scalar(
        select(Adapter).where(Adapter.owner == owner, Adapter.name == name).with_for_update()
    )
    if adapter is None:
        adapter = Adapter(id=new_id("ad"), tenant_id=tenant_id, owner=owner, name=name)
        s.add(adapter)
        s.flush()
    elif adapter.deleted_at is not None:
        # NOTE: a deleted name comes back with the next number, so that `name@1` of the
        # deleted adapter never names different content.
        adapter.deleted_at = None
    last = s.scalar(
        select(func.max(AdapterVersion.version)).where(AdapterVersion.adapter_id == adapter.id)
    )
    row = AdapterVersion(
        id=new_id("adv"),
        adapter_id=adapter.id,
        version=(last or 0) + 1,
        status=AdapterStatus.VALIDATING.value,
        report={},
        sha256=unpacked.sha256,
        size_bytes=unpacked.size_bytes,
        created_by=by.actor,
        staged=stage or adapter.gate_set is not None,
    )
    s.add(row)
    s.flush()
    audit(s, by, "adapter.upload", target_type="adapter", target_id=adapter.id, details={
        "name": name,
        "tenant_id": tenant_id,
        "version": row.version,
        "version_id": row.id,
        "sha256": unpacked.sha256,
        "size_bytes": unpacked.size_bytes,
        "staged": row.staged,
    })
    return version_view(row, adapter)


def withdraw_version(s: Session, version_id: str, *, by: AuditContext) -> None:
    """Undo insert_version for an upload no engine could validate: the version goes, and
    so does its adapter if the upload created it (or is marked deleted again if the
    upload revived it), so that the same upload can be retried as if never made."""
    row = s.get(AdapterVersion, version_id)
    if row is None or row.status != AdapterStatus.VALIDATING:
        return  # deleted meanwhile: the delete took care of it
    adapter = s.get(Adapter, row.adapter_id, with_for_update=True)
    assert adapter is not None
    details = {"name": adapter.name, "tenant_id": adapter.tenant_id,
               "version": row.version, "version_id": row.id}
    s.delete(row)
    s.flush()
    others = [v for v in adapter.versions if v.id != version_id]
    if not others:
        s.delete(adapter)
    elif all(v.status == AdapterStatus.DELETED for v in others):
        adapter.deleted_at = utcnow()
    audit(s, by, "adapter.upload_withdrawn", target_type="adapter", target_id=adapter.id,
          details=details)
    s.flush()


def finish_version(
    s: Session, version_id: str, status: AdapterStatus, report: dict[str, object]
) -> VersionView | None:
    """validating -> status; None if the version left `validating` meanwhile (deleted)."""
    row = s.get(AdapterVersion, version_id, with_for_update=True)
    if row is None or row.status != AdapterStatus.VALIDATING:
        return None
    row.status = status.value
    row.report = report
    rank = report.get("rank")
    if isinstance(rank, int):
        row.rank = rank
    s.flush()
    return version_view(row, row.adapter)


def _live_adapter(s: Session, adapter_id: str, owner: str | None) -> Adapter:
    """The adapter, locked for the change; 404 for an unknown or deleted one and, with
    owner, for anyone else's."""
    adapter = s.get(Adapter, adapter_id, with_for_update=True)
    if adapter is None or adapter.deleted_at is not None:
        raise adapter_not_found(adapter_id)
    if owner is not None and adapter.owner != owner:
        raise adapter_not_found(adapter_id)
    return adapter


def promote_version(
    s: Session, adapter_id: str, version: int, *, owner: str | None, by: AuditContext,
    reason: str = "promoted",
) -> AdapterView:
    """A staged ready version becomes what plain `name` resolves to. Refused (409) for a
    version that is not ready, not staged, or older than the current one (roll back
    instead)."""
    adapter = _live_adapter(s, adapter_id, owner)
    view = adapter_view(adapter)
    rows = {v.version: v for v in adapter.versions}
    row = rows.get(version)
    if row is None or row.status != AdapterStatus.READY:
        raise Conflict(f"Version {version} of '{adapter.name}' is not a ready version.",
                       code="version_not_ready")
    if not row.staged:
        raise Conflict(f"Version {version} of '{adapter.name}' is not staged.",
                       code="version_not_staged")
    current = view.current
    if current is not None and current.version > version:
        raise Conflict(
            f"Version {current.version} of '{adapter.name}' is current and newer than "
            f"{version}: roll back to reach an older version.", code="version_not_newer")
    row.staged = False
    audit(s, by, "adapter.promote", target_type="adapter", target_id=adapter.id, details={
        "name": adapter.name, "tenant_id": adapter.tenant_id, "version": version,
        "replaced": None if current is None else current.version, "reason": reason,
    })
    s.flush()
    return adapter_view(adapter)


def rollback_version(
    s: Session, adapter_id: str, *, owner: str | None, by: AuditContext
) -> AdapterView:
    """The current version goes back to staged, so that plain `name` resolves to the
    promoted version before it again. Refused (409) when there is none to go back to."""
    adapter = _live_adapter(s, adapter_id, owner)
    current = adapter_view(adapter).current
    older = [] if current is None else [
        v for v in adapter.versions
        if v.status == AdapterStatus.READY and not v.staged and v.version < current.version]
    if current is None or not older:
        raise Conflict(f"'{adapter.name}' has no earlier promoted version to roll back to.",
                       code="nothing_to_roll_back")
    row = next(v for v in adapter.versions if v.id == current.id)
    row.staged = True
    audit(s, by, "adapter.rollback", target_type="adapter", target_id=adapter.id, details={
        "name": adapter.name, "tenant_id": adapter.tenant_id, "from": current.version,
        "to": older[-1].version,
    })
    s.flush()
    return adapter_view(adapter)


def set_gate(
    s: Session, adapter_id: str, gate_set: bytes | None, threshold: float | None, *,
    by: AuditContext,
) -> AdapterView:
    """Turn the adapter's promotion gate on (with its eval set) or off (None)."""
    adapter = _live_adapter(s, adapter_id, None)
    adapter.gate_set = gate_set
    adapter.gate_threshold = threshold if gate_set is not None else None
    audit(s, by, "adapter.gate", target_type="adapter", target_id=adapter.id, details={
        "name": adapter.name, "on": gate_set is not None, "threshold": adapter.gate_threshold,
    })
    s.flush()
    return adapter_view(adapter)


def gate_of(s: Session, adapter_id: str) -> tuple[bytes | None, float | None]:
    adapter = s.get(Adapter, adapter_id)
    if adapter is None:
        return None, None
    return adapter.gate_set, adapter.gate_threshold


def mark_deleted(
    s: Session, adapter_id: str, *, owner: str | None, by: AuditContext
) -> tuple[AdapterView, list[str]]:
    """Delete an adapter and its versions; returns it and the engine names of the
    versions that were ready. owner None: any owner (admin)."""
    adapter = _live_adapter(s, adapter_id, owner)
    ready = [
        version_view(v, adapter).engine_name
        for v in adapter.versions
        if v.status == AdapterStatus.READY
    ]
    for v in adapter.versions:
        v.status = AdapterStatus.DELETED.value
    adapter.deleted_at = utcnow()
    audit(s, by, "adapter.delete", target_type="adapter", target_id=adapter.id, details={
        "name": adapter.name,
        "tenant_id": adapter.tenant_id,
        "versions": [v.version for v in adapter.versions],
    })
    s.flush()
    return adapter_view(adapter), ready


def digests_in_use(
    s: Session, digests: set[str], *, changed_after: datetime | None = None
) -> set[str]:
    """Those of `digests` a validating or ready version uses (or, with changed_after,
    any version changed since then)."""
    used: ColumnElement[bool] = AdapterVersion.status.in_(LIVE_STATUSES)
    if changed_after is not None:
        used = or_(used, AdapterVersion.updated_at >= changed_after)
    query = select(AdapterVersion.sha256).where(AdapterVersion.sha256.in_(digests), used)
    return {d for d in s.scalars(query) if d is not None}


def list_adapters(
    s: Session, *, owner: str | None = None, include_deleted: bool = False
) -> list[AdapterView]:
    query = select(Adapter).options(selectinload(Adapter.versions))
    if owner is not None:
        query = query.where(Adapter.owner == owner)
    if not include_deleted:
        query = query.where(Adapter.deleted_at.is_(None))
    return [adapter_view(a) for a in s.scalars(query.order_by(Adapter.created_at, Adapter.id))]


def get_adapter(s: Session, adapter_id: str, *, owner: str | None = None) -> AdapterView:
    """404 for an unknown id and, with owner, for anyone else's or a deleted one."""
    adapter = s.get(Adapter, adapter_id)
    if adapter is None:
        raise adapter_not_found(adapter_id)
    if owner is not None and (adapter.owner != owner or adapter.deleted_at is not None):
        raise adapter_not_found(adapter_id)
    return adapter_view(adapter)

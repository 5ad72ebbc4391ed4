"""The directory's snapshot: what it keeps of each row, how rows are read (all of them,
or those changed since a time), and how changed rows merge into a new snapshot."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from app.core.principal import AdapterRef, TenantInfo
from app.tables import Adapter, AdapterStatus, AdapterVersion, ApiKey, Isolation, Tenant, Tier
from app.tenants import tenant_quotas

_Row = TypeVar("_Row", Tenant, ApiKey, Adapter, AdapterVersion)


@dataclass(frozen=True, slots=True)
class KeyRow:
    id: str
    tenant_id: str | None
    is_admin: bool
    scopes: frozenset[str]
    expires_at: datetime | None
    revoked: bool


@dataclass(frozen=True, slots=True)
class TenantRow:
    info: TenantInfo
    deleted: bool


@dataclass(frozen=True, slots=True)
class AdapterRow:
    tenant_id: str | None
    name: str


@dataclass(frozen=True, slots=True)
class VersionRow:
    adapter_id: str
    version: int
    sha256: str
    created: int
    staged: bool


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Never mutated: a refresh builds a new one and swaps it in, so readers never lock."""

    keys: Mapping[str, KeyRow]  # by key_hash; revoked and expired ones too (clear 401s)
    tenants: Mapping[str, TenantRow]  # deleted ones too
    adapters: Mapping[str, AdapterRow]  # not deleted
    versions: Mapping[str, VersionRow]  # ready ones only
    # Derived: the ready versions requests may reach, by version id ...
    ready: Mapping[str, AdapterRef]
    # ... and by (owner tenant id or None for shared, name), oldest version first ...
    lines: Mapping[tuple[str | None, str], tuple[AdapterRef, ...]]
    # ... and what plain `name` resolves to: the newest of its line that is not staged
    # (no entry: every ready version is staged).
    current: Mapping[tuple[str | None, str], AdapterRef]


EMPTY = Snapshot(keys={}, tenants={}, adapters={}, versions={}, ready={}, lines={},
                 current={})


# ------------------------------------------------------------------------ row readers


def _key_row(row: ApiKey) -> KeyRow:
    return KeyRow(
        id=row.id,
        tenant_id=row.tenant_id,
        is_admin=row.is_admin,
        scopes=frozenset(row.scopes or ()),
        expires_at=row.expires_at,
        revoked=row.revoked_at is not None,
    )


def _tenant_row(row: Tenant) -> TenantRow:
    info = TenantInfo(
        id=row.id,
        name=row.name,
        tier=Tier(row.tier),
        isolation=Isolation(row.isolation),
        plan=row.plan,
        quotas=tenant_quotas(row),
        disabled=row.disabled or row.deleted_at is not None,
    )
    return TenantRow(info=info, deleted=row.deleted_at is not None)


def _version_row(row: AdapterVersion) -> VersionRow:
    return VersionRow(
        adapter_id=row.adapter_id,
        version=row.version,
        sha256=row.sha256 or "",
        created=int(row.created_at.timestamp()),
        staged=bool(row.staged),
    )


@dataclass(slots=True)
class Changes:
    """Rows read from the database (all of them, or those changed since the watermark)."""

    tenants: list[Tenant]
    keys: list[ApiKey]
    adapters: list[Adapter]
    versions: list[AdapterVersion]
    newest: datetime | None  # the latest updated_at among them


def read_changes(session: Session, since: datetime | None) -> Changes:
    def changed(query: Select[tuple[_Row]], model: type[_Row]) -> list[_Row]:
        if since is not None:
            query = query.where(model.updated_at >= since)
        return list(session.scalars(query))

    changes = Changes(
        tenants=changed(select(Tenant), Tenant),
        keys=changed(select(ApiKey), ApiKey),
        adapters=changed(select(Adapter), Adapter),
        versions=changed(select(AdapterVersion), AdapterVersion),
        newest=None,
    )
    stamps = [
        r.updated_at
        for group in (changes.tenants, changes.keys, changes.adapters, changes.versions)
        for r in group
    ]
    changes.newest = max(stamps, default=None)
    return changes


_Lines = dict[tuple[str | None, str], tuple[AdapterRef, ...]]


def _derive(
    tenants: Mapping[str, TenantRow],
    adapters: Mapping[str, AdapterRow],
    versions: Mapping[str, VersionRow],
) -> tuple[dict[str, AdapterRef], _Lines, dict[tuple[str | None, str], AdapterRef]]:
    refs: list[AdapterRef] = []
    for version_id, v in versions.items():
        adapter = adapters.get(v.adapter_id)
        if adapter is None:
            continue
        if adapter.tenant_id is not None:
            owner = tenants.get(adapter.tenant_id)
            if owner is None or owner.deleted:
                continue
        refs.append(
            AdapterRef(
                adapter_id=v.adapter_id,
                version_id=version_id,
                tenant_id=adapter.tenant_id,
                name=adapter.name,
                version=v.version,
                sha256=v.sha256,
                created=v.created,
            )
        )
    refs.sort(key=lambda r: (r.version, r.version_id))
    lines: defaultdict[tuple[str | None, str], list[AdapterRef]] = defaultdict(list)
    current: dict[tuple[str | None, str], AdapterRef] = {}
    for ref in refs:  # oldest first: the last one not staged stays
        lines[(ref.tenant_id, ref.name)].append(ref)
        if not versions[ref.version_id].staged:
            current[(ref.tenant_id, ref.name)] = ref
    return {r.version_id: r for r in refs}, {k: tuple(v) for k, v in lines.items()}, current


def merge(old: Snapshot, changes: Changes, *, full: bool) -> Snapshot:
    """A new snapshot: `old` with the changed rows applied (`full`: `changes` is all)."""
    keys = {} if full else dict(old.keys)
    for key in changes.keys:
        keys[key.key_hash] = _key_row(key)
    tenants = {} if full else dict(old.tenants)
    adapters = {} if full else dict(old.adapters)
    versions = {} if full else dict(old.versions)
    # NOTE: most refreshes re-read only rows already known (the overlap): the derived
    # maps are rebuilt only when something that feeds them changed.
    dirty = full
    for tenant in changes.tenants:
        row = _tenant_row(tenant)
        before = tenants.get(tenant.id)
        dirty |= before is None or before.deleted != row.deleted
        tenants[tenant.id] = row
    for adapter in changes.adapters:
        before_adapter = adapters.pop(adapter.id, None)
        if adapter.deleted_at is None:
            adapters[adapter.id] = AdapterRow(tenant_id=adapter.tenant_id, name=adapter.name)
        dirty |= before_adapter != adapters.get(adapter.id)
    for version in changes.versions:
        before_version = versions.pop(version.id, None)
        if version.status == AdapterStatus.READY.value:
            versions[version.id] = _version_row(version)
        dirty |= before_version != versions.get(version.id)
    ready, lines, current = (
        _derive(tenants, adapters, versions) if dirty else (old.ready, old.lines, old.current)
    )
    return Snapshot(
        keys=keys, tenants=tenants, adapters=adapters, versions=versions,
        ready=ready, lines=lines, current=current,
    )

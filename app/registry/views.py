"""What the registry hands out about adapters: frozen snapshots of database rows."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from app.core.errors import InvalidInput, NotFound
from app.core.principal import REGISTRY_ENGINE_PREFIX
from app.tables import Adapter, AdapterStatus, AdapterVersion

# What tenants call an adapter in `model` (before an optional "@<version>").
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Adapter.owner of adapters every tenant may use.
SHARED_OWNER = "shared"


@dataclass(frozen=True, slots=True)
class VersionView:
    id: str
    adapter_id: str
    name: str
    tenant_id: str | None  # None: shared
    version: int
    status: AdapterStatus
    # Ready but not what plain `name` resolves to until promoted (the promotion gate).
    staged: bool
    # ready: rank, alpha, use_rslora, target_modules, size_bytes (stored), memory_bytes;
    # failed: error (the reason).
    report: dict[str, Any]
    sha256: str | None
    size_bytes: int | None
    created_by: str | None
    created_at: datetime

    @property
    def engine_name(self) -> str:
        """The name the engine serves this version under (AdapterRef.engine_name)."""
        return f"{REGISTRY_ENGINE_PREFIX}{self.id}"


@dataclass(frozen=True, slots=True)
class AdapterView:
    id: str
    name: str
    tenant_id: str | None
    created_at: datetime
    updated_at: datetime
    deleted_at: datetime | None
    versions: tuple[VersionView, ...] = field(default_factory=tuple)  # oldest first
    gated: bool = False  # new versions are staged until their gate eval passes
    gate_threshold: float | None = None

    @property
    def latest_ready(self) -> int | None:
        """The version plain `name` resolves to: the newest ready one not staged."""
        current = current_version(self.versions)
        return None if current is None else current.version

    @property
    def current(self) -> VersionView | None:
        return current_version(self.versions)


def current_version(versions: tuple[VersionView, ...]) -> VersionView | None:
    """The newest ready version that is not staged (versions oldest first)."""
    for v in reversed(versions):
        if v.status == AdapterStatus.READY and not v.staged:
            return v
    return None


@dataclass(frozen=True, slots=True)
class SyncResult:
    """What one on_versions_changed() did to this replica's engine (engine names)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    failed: dict[str, str] = field(default_factory=dict)  # name -> reason


def version_view(row: AdapterVersion, adapter: Adapter) -> VersionView:
    return VersionView(
        id=row.id,
        adapter_id=adapter.id,
        name=adapter.name,
        tenant_id=adapter.tenant_id,
        version=row.version,
        status=AdapterStatus(row.status),
        staged=bool(row.staged),
        report=dict(row.report or {}),
        sha256=row.sha256,
        size_bytes=row.size_bytes,
        created_by=row.created_by,
        created_at=row.created_at,
    )


def adapter_view(adapter: Adapter) -> AdapterView:
    return AdapterView(
        id=adapter.id,
        name=adapter.name,
        tenant_id=adapter.tenant_id,
        created_at=adapter.created_at,
        updated_at=adapter.updated_at,
        deleted_at=adapter.deleted_at,
        versions=tuple(version_view(v, adapter) for v in adapter.versions),
        gated=adapter.gate_set is not None,
        gate_threshold=adapter.gate_threshold,
    )


def check_adapter_name(name: str, *, base_model_id: str) -> None:
    if not ADAPTER_NAME.fullmatch(name):
        raise InvalidInput(
            f"Invalid adapter name {name!r}: 1-64 characters among letters, digits and '._-', "
            "starting with a letter or digit ('@' separates a version, '/' is not allowed).",
            param="name",
            code="invalid_adapter_name",
        )
    if name == base_model_id:
        raise InvalidInput(
            f"The adapter name {name!r} is the base model's name.",
            param="name",
            code="invalid_adapter_name",
        )


def adapter_not_found(adapter_id: str) -> NotFound:
    # NOTE: the same answer for another tenant's adapter: never reveal that it exists.
    return NotFound(f"No adapter with id '{adapter_id}'.")


def tenant_not_found(tenant_id: str) -> NotFound:
    return NotFound(f"No tenant with id '{tenant_id}'.", param="tenant_id")

"""Adapter registry bodies: versions, adapters and their lists (times in unix seconds).
Uploads are multipart forms (file, name, tenant_id), read by app.registry.upload_form."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from app.models import AdapterStatus
from app.registry.views import AdapterView, VersionView


def _unix(value: datetime) -> int:
    return int(value.timestamp())


class AdapterVersionOut(BaseModel):
    object: Literal["adapter.version"] = "adapter.version"
    id: str  # the version's id
    adapter_id: str
    name: str
    tenant_id: str | None  # None: shared with every tenant
    version: int
    status: AdapterStatus
    # ready: rank, alpha, use_rslora, target_modules, size_bytes, ...; failed: error
    report: dict[str, Any]
    sha256: str | None
    size_bytes: int | None
    created_by: str | None
    created_at: int

    @classmethod
    def of(cls, view: VersionView) -> AdapterVersionOut:
        return cls(
            id=view.id,
            adapter_id=view.adapter_id,
            name=view.name,
            tenant_id=view.tenant_id,
            version=view.version,
            status=view.status,
            report=view.report,
            sha256=view.sha256,
            size_bytes=view.size_bytes,
            created_by=view.created_by,
            created_at=_unix(view.created_at),
        )


class AdapterOut(BaseModel):
    object: Literal["adapter"] = "adapter"
    id: str
    name: str
    tenant_id: str | None
    # The version plain `name` resolves to: the newest ready one.
    latest_version: int | None
    created_at: int
    updated_at: int
    deleted_at: int | None
    versions: list[AdapterVersionOut]  # oldest first

    @classmethod
    def of(cls, view: AdapterView) -> AdapterOut:
        return cls(
            id=view.id,
            name=view.name,
            tenant_id=view.tenant_id,
            latest_version=view.latest_ready,
            created_at=_unix(view.created_at),
            updated_at=_unix(view.updated_at),
            deleted_at=None if view.deleted_at is None else _unix(view.deleted_at),
            versions=[AdapterVersionOut.of(v) for v in view.versions],
        )


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterOut]

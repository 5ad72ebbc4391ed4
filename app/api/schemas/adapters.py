"""Adapter registry bodies: versions, adapters and their lists (times in unix seconds).
Uploads are multipart forms (file, name, tenant_id), read by app.registry.upload_form;
they answer the adapter (AdapterUploadOut)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.evals.service import EvalView
from app.registry.views import AdapterView, VersionView
from app.tables import AdapterStatus


def _unix(value: datetime) -> int:
    return int(value.timestamp())


class VersionFields(BaseModel):
    """What one version of an adapter is: in AdapterVersionOut, and flat in an upload's
    answer (AdapterUploadOut). The names are VersionView's."""

    version: int
    status: AdapterStatus
    # Ready but not what plain `name` resolves to until promoted (the promotion gate).
    staged: bool
    # ready: rank, alpha, use_rslora, target_modules, size_bytes, ...; failed: error
    report: dict[str, Any]
    sha256: str | None
    size_bytes: int | None
    created_by: str | None

    @staticmethod
    def fields_of(view: VersionView) -> dict[str, Any]:
        return {name: getattr(view, name) for name in VersionFields.model_fields}


class AdapterVersionOut(VersionFields):
    object: Literal["adapter.version"] = "adapter.version"
    id: str  # the version's id
    adapter_id: str
    name: str
    tenant_id: str | None  # None: shared with every tenant
    created_at: int

    @classmethod
    def of(cls, view: VersionView) -> AdapterVersionOut:
        return cls(
            **VersionFields.fields_of(view),
            id=view.id,
            adapter_id=view.adapter_id,
            name=view.name,
            tenant_id=view.tenant_id,
            created_at=_unix(view.created_at),
        )


class AdapterOut(BaseModel):
    object: Literal["adapter"] = "adapter"
    id: str
    name: str
    tenant_id: str | None
    # The version plain `name` resolves to: the newest ready one not staged.
    latest_version: int | None
    # The promotion gate: new versions are staged until they score at least what the
    # current one does on the gate's eval set (and gate_threshold, where set).
    gated: bool
    gate_threshold: float | None
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
            gated=view.gated,
            gate_threshold=view.gate_threshold,
            created_at=_unix(view.created_at),
            updated_at=_unix(view.updated_at),
            deleted_at=None if view.deleted_at is None else _unix(view.deleted_at),
            versions=[AdapterVersionOut.of(v) for v in view.versions],
        )


# NOTE: pydantic orders fields by the reversed MRO: AdapterOut's come first in the JSON.
class AdapterUploadOut(VersionFields, AdapterOut):
    """What an upload answers: the adapter, as GET /…/adapters/{id} shows it, plus the
    version the upload made, flat (as uploads answered before they answered the
    adapter)."""

    # NOTE: `id` is the adapter's, so that the collection's GET and DELETE take it.
    adapter_id: str  # the same as id
    version_id: str

    @classmethod
    def of_upload(cls, adapter: AdapterView, version: VersionView) -> AdapterUploadOut:
        assert adapter.id == version.adapter_id
        return cls(
            **AdapterOut.of(adapter).model_dump(exclude={"object"}),
            **VersionFields.fields_of(version),
            adapter_id=adapter.id,
            version_id=version.id,
        )


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterOut]


class AdapterUpload(BaseModel):
    """The tenant upload form (POST /v1/adapters): multipart, read by read_upload_form."""

    file: bytes  # a .zip or .tar.gz of a PEFT directory
    name: str


class AdminAdapterUpload(AdapterUpload):
    """The admin upload form (POST /admin/adapters)."""

    tenant_id: str = ""  # omitted or empty: shared with every tenant
    stage: Literal["", "true", "false"] = ""  # "true": staged until promoted (the gate)


class AdapterImport(BaseModel):
    """POST /admin/adapters/import: an adapter from an object store prefix."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    source: str = Field(min_length=1, max_length=2048)  # s3://bucket/path/
    tenant_id: str | None = None  # None: shared with every tenant


class OrphanCollection(BaseModel):
    """POST /admin/adapters/gc: stored adapter files no version uses, removed."""

    removed: list[str]  # their content addresses (sha256)


class EvalOut(BaseModel):
    """An eval of an adapter version (app/evals/): the share of the set's items the
    version, the ready version before it and the base model got right."""

    object: Literal["adapter.eval"] = "adapter.eval"
    id: str
    adapter_id: str
    version: int
    previous_version: int | None
    status: Literal["running", "done", "failed"]
    set_sha256: str
    num_items: int
    # Progress: items scored over every model (num_items x 2 or 3).
    done_items: int
    total_items: int
    # {"version", "previous", "base"}: each a fraction from 0 to 1, null until scored.
    scores: dict[str, float | None]
    error: str | None
    created_by: str | None
    created_at: int
    finished_at: int | None
    gate: bool  # run by the promotion gate on a staged version
    gate_outcome: str | None  # once done: "promoted", or why the version stays staged

    @classmethod
    def of(cls, view: EvalView) -> EvalOut:
        return cls(
            id=view.id, adapter_id=view.adapter_id, version=view.version,
            previous_version=view.previous_version, status=view.status.value,
            set_sha256=view.set_sha256, num_items=view.num_items,
            done_items=view.done_items, total_items=view.total_items, scores=view.scores,
            error=view.error, created_by=view.created_by, created_at=_unix(view.created_at),
            finished_at=None if view.finished_at is None else _unix(view.finished_at),
            gate=view.gate, gate_outcome=view.gate_outcome,
        )


class EvalList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EvalOut]

"""Bodies of the admin routes for tenants, API keys and the audit log.

NOTE: request bodies forbid unknown fields: a body that names `id`, `tenant_id`,
`is_admin` or `key_hash` is refused (400, with the field as `param`) rather than
silently ignored, so that nobody believes they set what they cannot set.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from app.core.principal import Quotas
from app.tables import ApiKey, AuditLog, Isolation, Scope, Tenant, Tier
from app.tenants import tenant_quotas

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1

# Names people read in lists and invoices: no control characters, no edge whitespace.
_TENANT_NAME = r"^[A-Za-z0-9]([A-Za-z0-9 ._\-]*[A-Za-z0-9._\-])?$"
_PLAN_NAME = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
_PRINTABLE = r"^[^\x00-\x1f\x7f]+$"
TenantName = Annotated[str, Field(min_length=1, max_length=128, pattern=_TENANT_NAME)]
PlanName = Annotated[str, Field(min_length=1, max_length=64, pattern=_PLAN_NAME)]
KeyName = Annotated[str, Field(min_length=1, max_length=128, pattern=_PRINTABLE)]
# Each quota fits its column (32- or 64-bit); None is unlimited.
Limit32 = Annotated[int | None, Field(ge=1, le=_INT32_MAX, strict=True)]
Limit64 = Annotated[int | None, Field(ge=1, le=_INT64_MAX, strict=True)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def unix(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


# ---------------------------------------------------------------------------- tenants


class QuotasBody(_Body):
    """Per-tenant limits; omitted or null: unlimited."""

    rpm: Limit32 = None
    tpm: Limit64 = None
    max_concurrency: Limit32 = None
    monthly_tokens: Limit64 = None
    max_tokens: Limit32 = None
    max_context_tokens: Limit32 = None
    max_adapters: Limit32 = None

    def to_quotas(self) -> Quotas:
        return Quotas(**self.model_dump())

    def set_fields(self) -> dict[str, int | None]:
        """Only the quotas the body named (an explicit null included)."""
        return {name: getattr(self, name) for name in self.model_fields_set}


class TenantCreate(_Body):
    name: TenantName
    tier: Tier = Tier.STANDARD
    isolation: Isolation = Isolation.SHARED
    quotas: QuotasBody = Field(default_factory=QuotasBody)
    plan: PlanName | None = None


class TenantUpdate(_Body):
    """A partial update: omitted fields keep their value; quotas merge field by field."""

    name: TenantName | None = None
    tier: Tier | None = None
    isolation: Isolation | None = None
    quotas: QuotasBody | None = None
    plan: PlanName | None = None  # null: no plan
    disabled: bool | None = None


class QuotasOut(BaseModel):
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    monthly_tokens: int | None
    max_tokens: int | None
    max_context_tokens: int | None
    max_adapters: int | None


class TenantOut(BaseModel):
    id: str
    object: Literal["tenant"] = "tenant"
    name: str
    tier: Tier
    isolation: Isolation
    plan: str | None
    quotas: QuotasOut
    disabled: bool
    created_at: int
    updated_at: int
    deleted_at: int | None

    @classmethod
    def of(cls, row: Tenant) -> TenantOut:
        quotas = tenant_quotas(row)
        return cls(
            id=row.id,
            name=row.name,
            tier=Tier(row.tier),
            isolation=Isolation(row.isolation),
            plan=row.plan,
            quotas=QuotasOut(**{f: getattr(quotas, f) for f in QuotasOut.model_fields}),
            disabled=row.disabled,
            created_at=int(row.created_at.timestamp()),
            updated_at=int(row.updated_at.timestamp()),
            deleted_at=unix(row.deleted_at),
        )


# ------------------------------------------------------------------------------- keys


class TenantKeyCreate(_Body):
    name: KeyName
    scopes: list[Scope] | None = Field(default=None, min_length=1)  # omitted: ["inference"]
    expires_at: AwareDatetime | None = None  # ISO 8601 with a zone, or unix seconds


class AdminKeyCreate(_Body):
    name: KeyName
    expires_at: AwareDatetime | None = None


class KeyOut(BaseModel):
    """A key as lists show it: its prefix, never the key or its hash."""

    id: str
    object: Literal["api_key"] = "api_key"
    name: str
    prefix: str
    tenant_id: str | None
    is_admin: bool
    scopes: list[str]
    created_at: int
    created_by: str | None
    expires_at: int | None
    revoked_at: int | None

    @classmethod
    def fields_of(cls, row: ApiKey) -> dict[str, Any]:
        return {
            "id": row.id,
            "name": row.name,
            "prefix": row.prefix,
            "tenant_id": row.tenant_id,
            "is_admin": row.is_admin,
            "scopes": list(row.scopes),
            "created_at": int(row.created_at.timestamp()),
            "created_by": row.created_by,
            "expires_at": unix(row.expires_at),
            "revoked_at": unix(row.revoked_at),
        }

    @classmethod
    def of(cls, row: ApiKey) -> KeyOut:
        return cls(**cls.fields_of(row))


class CreatedKeyOut(KeyOut):
    key: str  # shown this once; only its hash is kept


# ------------------------------------------------------------------------------ audit


class AuditOut(BaseModel):
    id: int
    object: Literal["audit_log.entry"] = "audit_log.entry"
    at: int
    actor: str
    action: str
    target_type: str
    target_id: str | None
    details: dict[str, Any]
    request_id: str | None

    @classmethod
    def of(cls, row: AuditLog) -> AuditOut:
        return cls(
            id=row.id,
            at=int(row.at.timestamp()),
            actor=row.actor,
            action=row.action,
            target_type=row.target_type,
            target_id=row.target_id,
            details=row.details,
            request_id=row.request_id,
        )


Item = TypeVar("Item", bound=BaseModel)


class ListOf(BaseModel, Generic[Item]):
    object: Literal["list"] = "list"
    data: list[Item]

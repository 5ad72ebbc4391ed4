"""The service's records: SQLAlchemy 2.0 typed ORM. Every change here is an Alembic
migration in migrations/versions/."""

from __future__ import annotations

import enum
import secrets
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

# Constraint names are fixed so that migrations can name what they drop or alter.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """Public ids carry their kind: ten_..., key_..., ad_..., adv_..."""
    return f"{prefix}_{secrets.token_hex(8)}"


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend (SQLite stores no zone: naive UTC there)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert value.tzinfo is not None, "datetimes stored must be timezone-aware"
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime(), dict[str, Any]: JSON}


class Tier(enum.StrEnum):
    """Service tier; the engine serves a lower priority number first."""

    PREMIUM = "premium"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def priority(self) -> int:
        return {"premium": 0, "standard": 1, "batch": 2}[self.value]


class Isolation(enum.StrEnum):
    SHARED = "shared"  # any worker
    DEDICATED = "dedicated"  # workers of its own (placement)


class AdapterStatus(enum.StrEnum):
    VALIDATING = "validating"
    READY = "ready"
    FAILED = "failed"
    DELETED = "deleted"


class UsageStatus(enum.StrEnum):
    OK = "ok"
    ABORTED = "aborted"  # the client went away (or the server drained): billed as delivered
    ERROR = "error"


class Scope(enum.StrEnum):
    INFERENCE = "inference"
    ADAPTERS_WRITE = "adapters:write"


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    tier: Mapped[str] = mapped_column(String(16), default=Tier.STANDARD.value)
    isolation: Mapped[str] = mapped_column(String(16), default=Isolation.SHARED.value)
    plan: Mapped[str | None] = mapped_column(String(64))
    # Quotas; NULL is unlimited.
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrency: Mapped[int | None] = mapped_column(Integer)
    monthly_tokens: Mapped[int | None] = mapped_column(BigInteger)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    max_context_tokens: Mapped[int | None] = mapped_column(Integer)
    max_adapters: Mapped[int | None] = mapped_column(Integer)
    # A disabled (or deleted) tenant's keys stop working; its usage rows stay for billing.
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    deleted_at: Mapped[datetime | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Bumped on every change: replicas poll for rows changed since they last looked.
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow, index=True)

    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    # NULL for admin keys.
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id"), index=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    name: Mapped[str] = mapped_column(String(128))
    # What the key starts with, for people to recognise it; never enough to use it.
    prefix: Mapped[str] = mapped_column(String(32))
    # Keyed SHA-256 (HMAC) of the whole key, hex; the key itself is never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list[str]] = mapped_column(JSON, default=list)
    expires_at: Mapped[datetime | None] = mapped_column()
    revoked_at: Mapped[datetime | None] = mapped_column()
    created_by: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow, index=True)

    tenant: Mapped[Tenant | None] = relationship(back_populates="keys")


class Adapter(Base):
    """A name under which a tenant (or everyone, when shared) reaches a line of versions."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("owner", "name", name="uq_adapters_owner_name"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    # NULL: shared with every tenant.
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id"), index=True)
    # The tenant id, or "shared": unique with the name (NULLs never collide in SQL).
    owner: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(128))
    # The promotion gate (app/evals/gate.py): with an eval set, a new version is staged
    # until it scores at least what the current one does (and gate_threshold, if set).
    gate_set: Mapped[bytes | None] = mapped_column(LargeBinary)
    gate_threshold: Mapped[float | None] = mapped_column(Float)
    deleted_at: Mapped[datetime | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow, index=True)

    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="adapter", order_by="AdapterVersion.version"
    )


class AdapterVersion(Base):
    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "version", name="uq_adapter_versions_adapter_version"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.id"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=AdapterStatus.VALIDATING.value)
    # Staged: ready and served as `name@N`, but plain `name` goes to the newest ready
    # version that is not staged (until this one is promoted).
    staged: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # What validation found: the reason of a failure, or rank / targets / sizes.
    report: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # sha256 of the stored weights + config: the directory's name in the store.
    sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    rank: Mapped[int | None] = mapped_column(Integer)
    created_by: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow, index=True)

    adapter: Mapped[Adapter] = relationship(back_populates="versions")


class EvalStatus(enum.StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class AdapterEval(Base):
    """An eval set run on one adapter version, the version before it and the base model
    (app/evals/): the share of items each got right."""

    __tablename__ = "adapter_evals"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.id"), index=True)
    version_id: Mapped[str] = mapped_column(ForeignKey("adapter_versions.id"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    # The ready version before it, compared against; NULL: it is the first.
    previous_version: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=EvalStatus.RUNNING.value)
    # sha256 of the eval set file: scores compare only between runs of one set.
    set_sha256: Mapped[str] = mapped_column(String(64))
    num_items: Mapped[int] = mapped_column(Integer)
    # Items scored so far, over every model run (num_items x the models).
    done_items: Mapped[int] = mapped_column(Integer, default=0)
    # {"version": 0.9, "previous": 0.7 or null, "base": 0.2}, once done.
    scores: Mapped[dict[str, Any]] = mapped_column(default=dict)
    error: Mapped[str | None] = mapped_column(String(1024))
    # An eval the promotion gate ran on a staged version: what it decided once done
    # ("promoted", or why the version stays staged); NULL for other evals.
    gate: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    gate_outcome: Mapped[str | None] = mapped_column(String(256))
    created_by: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column()


class UsageRecord(Base):
    """One per API request (all its choices); written at least once, counted once."""

    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    # NULL: served without keys (--no-auth).
    tenant_id: Mapped[str | None] = mapped_column(String(32))
    key_id: Mapped[str | None] = mapped_column(String(32))
    # The model field as the engine ran it: the base model id or an adapter's name.
    model: Mapped[str] = mapped_column(String(160))
    adapter_id: Mapped[str | None] = mapped_column(String(32))
    adapter_version: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float] = mapped_column(Float, default=0.0)
    status: Mapped[str] = mapped_column(String(16))
    # When the request arrived.
    created_at: Mapped[datetime] = mapped_column()
    # The final invoice that billed this row; NULL until one does (app/billing/service.py).
    invoice_id: Mapped[str | None] = mapped_column(String(32), index=True)


class AuditLog(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    # The admin key's id, "bootstrap" for LORAPLEX_ADMIN_KEY, "local" without auth.
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(64))  # "tenant.create", "key.revoke", ...
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str | None] = mapped_column(String(64))
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    request_id: Mapped[str | None] = mapped_column(String(128))


class PlanRecord(Base):
    """A price plan (app/billing/plans.py PricePlan); tenants name it in `plan`.

    NOTE: money is stored as the decimal strings it was given in, so that a price reads
    back digit for digit the same on SQLite and PostgreSQL.
    """

    __tablename__ = "price_plans"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    currency: Mapped[str] = mapped_column(String(3))
    prompt_per_mtok: Mapped[str] = mapped_column(String(40))
    completion_per_mtok: Mapped[str] = mapped_column(String(40))
    cached_prompt_per_mtok: Mapped[str] = mapped_column(String(40))
    adapter_month: Mapped[str] = mapped_column(String(40))
    monthly_minimum: Mapped[str] = mapped_column(String(40))
    volume_tiers: Mapped[list[Any]] = mapped_column(JSON, default=list)
    adapter_overrides: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_by: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class InvoiceRecord(Base):
    """A tenant's invoice for one month: a draft until finalised, then never changed."""

    __tablename__ = "invoices"
    __table_args__ = (
        UniqueConstraint("tenant_id", "period", name="uq_invoices_tenant_id_period"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    period: Mapped[str] = mapped_column(String(7))  # "YYYY-MM"
    status: Mapped[str] = mapped_column(String(16))  # draft | final
    plan: Mapped[str] = mapped_column(String(64))
    currency: Mapped[str] = mapped_column(String(3))
    total: Mapped[str] = mapped_column(String(40))  # decimal string
    # The whole invoice (app/billing/invoice.py Invoice) as JSON, money as decimal strings.
    document: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finalized_at: Mapped[datetime | None] = mapped_column()

"""Who is calling, and what they may use: in-memory snapshots the hot path reads
(never a SQL query per request)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.tables import Isolation, Scope, Tier

# The engine names of registry adapter versions start with this; other engine adapters are
# the operator's preloaded ones (`--lora`), whose names must not.
REGISTRY_ENGINE_PREFIX = "av/"


@dataclass(frozen=True, slots=True)
class Quotas:
    """A tenant's limits; None is unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    monthly_tokens: int | None = None
    max_tokens: int | None = None  # per request; also the default when a request omits it
    max_context_tokens: int | None = None  # prompt + max_tokens
    max_adapters: int | None = None  # adapters (names) the tenant may own


@dataclass(frozen=True, slots=True)
class TenantInfo:
    id: str
    name: str
    tier: Tier
    isolation: Isolation
    plan: str | None
    quotas: Quotas
    disabled: bool = False


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one request, resolved from its bearer key."""

    actor: str  # the key's id; "bootstrap" (LORAPLEX_ADMIN_KEY); "local" (--no-auth)
    key_id: str | None  # None for the bootstrap admin key and without auth
    tenant: TenantInfo | None  # None for admin keys and without auth
    is_admin: bool
    scopes: frozenset[str] = field(default_factory=frozenset)
    # An admin acting for a tenant (header X-Loraplex-Tenant): whose adapters it may use.
    # NOTE: only the adapters change hands. `tenant` stays None, so the call is the
    # admin's own: no tenant quota admits it, no tenant limit caps it, and its usage row
    # carries no tenant_id (the admin's key_id), so it is never billed to the tenant.
    acting_for: TenantInfo | None = None

    @property
    def tenant_id(self) -> str | None:
        return None if self.tenant is None else self.tenant.id

    @property
    def adapter_owner_id(self) -> str | None:
        """The tenant whose own adapters (besides the shared ones) the caller may use."""
        if self.acting_for is not None:
            return self.acting_for.id
        return self.tenant_id

    def has_scope(self, scope: Scope) -> bool:
        return self.is_admin or scope.value in self.scopes


LOCAL_PRINCIPAL = Principal(
    actor="local",
    key_id=None,
    tenant=None,
    is_admin=True,
    scopes=frozenset(s.value for s in Scope),
)


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """One ready adapter version as requests reach it."""

    adapter_id: str
    version_id: str
    tenant_id: str | None  # None: shared with every tenant
    name: str  # as tenants name it in `model` (without @version)
    version: int
    sha256: str
    created: int  # unix seconds

    @property
    def engine_name(self) -> str:
        """The name the engine serves this version under: unique across tenants."""
        return f"{REGISTRY_ENGINE_PREFIX}{self.version_id}"

"""A benchmark's tenants, made through the admin API as an operator makes them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class TenantKey:
    tenant_id: str
    key: str  # the API key, shown once

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def create_tenant(
    base_url: str, admin_key: str, name: str, *, tier: str = "standard",
    quotas: Mapping[str, int] | None = None, scopes: Sequence[str] | None = None,
) -> TenantKey:
    """A shared-isolation tenant (`quotas`; None: the tier's) and one API key for it
    (`scopes`; None: inference only)."""
    tenant: dict[str, object] = {"name": name, "tier": tier, "isolation": "shared"}
    if quotas is not None:
        tenant["quotas"] = dict(quotas)
    key: dict[str, object] = {"name": "bench"}
    if scopes is not None:
        key["scopes"] = list(scopes)
    headers = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as admin:
        response = admin.post("/admin/tenants", json=tenant)
        response.raise_for_status()
        tenant_id = str(response.json()["id"])
        response = admin.post(f"/admin/tenants/{tenant_id}/keys", json=key)
        response.raise_for_status()
        return TenantKey(tenant_id, str(response.json()["key"]))

"""Setting up tenants, keys and adapters through the admin API, as an operator would."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import httpx

ADMIN_KEY = "test-admin-key-0123456789abcdef"
SECRET_KEY = "test-secret-key-0123456789abcdef0123456789"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def create_tenant(
    client: httpx.Client, name: str, *, tier: str = "standard", **quotas: int | None
) -> dict[str, Any]:
    response = client.post(
        "/admin/tenants",
        json={"name": name, "tier": tier, "isolation": "shared", "quotas": quotas},
        headers=bearer(ADMIN_KEY),
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def create_key(
    client: httpx.Client, tenant_id: str, *, scopes: list[str] | None = None, **fields: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"name": "test", **fields}
    if scopes is not None:
        body["scopes"] = scopes
    response = client.post(
        f"/admin/tenants/{tenant_id}/keys", json=body, headers=bearer(ADMIN_KEY)
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def tar_gz(adapter_dir: Path) -> bytes:
    """A .tar.gz of a PEFT directory, the way `tar czf x.tar.gz adapter/` writes it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(adapter_dir / name, arcname=f"adapter/{name}")
    return buffer.getvalue()


def upload_adapter(
    client: httpx.Client, key: str, name: str, adapter_dir: Path, *, path: str = "/v1/adapters"
) -> httpx.Response:
    return client.post(
        path,
        files={"file": ("adapter.tar.gz", tar_gz(adapter_dir), "application/gzip")},
        data={"name": name},
        headers=bearer(key),
    )

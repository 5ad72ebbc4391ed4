"""The demo's tenants, keys and adapters, set up in a running app; a second run against
the same data dir changes nothing that is still valid.

NOTE: keys are stored only as hashes, so the demo keeps the plaintext of the keys it
mints in <data dir>/demo/keys.json (mode 0600) and prints them again at the next start
while they still work. A key that no longer works (revoked, expired, minted under
another secret, its file lost) is replaced by a new one, and the old key, if still
live, is revoked: nobody can use a demo key whose plaintext the demo lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app import tenants as crud
from app.api.state import AppState
from app.audit import AuditContext
from app.core.errors import ServiceError
from app.core.security import generate_key, hash_key
from app.db import session_scope
from app.demo.cache import TrainedAdapter
from app.demo.catalog import DEMO_TENANTS, DemoTenant
from app.registry.archive import CONFIG_FILE, WEIGHTS_FILE, content_digest
from app.registry.service import AdapterRegistry
from app.registry.views import SHARED_OWNER, VersionView
from app.tables import AdapterStatus, ApiKey, EvalStatus, Tenant

logger = logging.getLogger("loraplex.demo")

DEMO_ACTOR = AuditContext(actor="demo")
DEMO_KEY_NAME = "demo"
KEYS_FILE = "keys.json"
ADMIN_KEY_FILE = "admin-key"
ENGINE_LOAD_WAIT_S = 300.0


class DemoError(RuntimeError):
    """The demo cannot set itself up in this data dir; the message says why."""


@dataclass(frozen=True, slots=True)
class AdminKey:
    key: str
    source: str  # "LORAPLEX_ADMIN_KEY" or the file it is kept in


@dataclass(frozen=True, slots=True)
class TenantCredentials:
    name: str
    tenant_id: str
    tier: str
    key_id: str
    key: str
    reused: bool  # the key printed at an earlier start


@dataclass(frozen=True, slots=True)
class SeededAdapter:
    name: str
    owner: str | None  # a tenant's name; None: shared
    adapter_id: str
    version: int
    uploaded: bool  # False: the registry already had this content as the latest version


@dataclass(frozen=True, slots=True)
class DemoSetup:
    tenants: tuple[TenantCredentials, ...]
    adapters: tuple[SeededAdapter, ...]


# ------------------------------------------------------------------------------ files


def write_private(path: Path, text: str) -> None:
    """Write atomically, readable by the owner only (mode 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_admin_key(demo_dir: Path, configured: str | None) -> AdminKey:
    """LORAPLEX_ADMIN_KEY when set; else the one kept in <demo dir>/admin-key, made once."""
    if configured:
        return AdminKey(configured, "LORAPLEX_ADMIN_KEY")
    path = demo_dir / ADMIN_KEY_FILE
    if path.is_file() and (kept := path.read_text().strip()):
        return AdminKey(kept, str(path))
    # The bootstrap key is only compared by hash: any secret string works; this one looks
    # like the admin keys the server mints (lpx_a_...).
    key = generate_key("a", secrets.token_hex(16)).key
    write_private(path, key + "\n")
    return AdminKey(key, str(path))


def _read_keys(path: Path) -> dict[str, dict[str, str]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(v, dict)}


# ---------------------------------------------------------------------------- tenants


def seed_tenants(state: AppState, demo_dir: Path) -> list[TenantCredentials]:
    """Create the demo tenants (once) and a working key for each; blocking."""
    secret = state.settings.resolved_secret_key()
    keys_path = demo_dir / KEYS_FILE
    kept = _read_keys(keys_path)
    credentials: list[TenantCredentials] = []
    with session_scope(state.db) as session:
        for spec in DEMO_TENANTS:
            tenant = _ensure_tenant(session, spec)
            credentials.append(_ensure_key(session, tenant, kept.get(spec.name), secret))
    write_private(keys_path, json.dumps(
        {c.name: {"tenant_id": c.tenant_id, "key_id": c.key_id, "key": c.key}
         for c in credentials},
        indent=2,
    ) + "\n")
    return credentials


def _ensure_tenant(session: Session, spec: DemoTenant) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == spec.name))
    if tenant is None:
        return crud.create_tenant(session, name=spec.name, tier=spec.tier, by=DEMO_ACTOR)
    if tenant.deleted_at is not None:
        raise DemoError(
            f"the demo tenant '{spec.name}' was deleted, and a deleted tenant's name is "
            "never reused: run the demo with a fresh LORAPLEX_DATA_DIR"
        )
    return tenant


def _ensure_key(
    session: Session, tenant: Tenant, kept: dict[str, str] | None, secret: str
) -> TenantCredentials:
    row = None if kept is None else _live_key(session, tenant, kept, secret)
    if row is not None and kept is not None:
        return TenantCredentials(tenant.name, tenant.id, tenant.tier, row.id, kept["key"],
                                 reused=True)
    # The plaintext of any other live demo key is lost: revoke it.
    stale = list(session.scalars(select(ApiKey).where(
        ApiKey.tenant_id == tenant.id, ApiKey.name == DEMO_KEY_NAME, ApiKey.revoked_at.is_(None)
    )))
    for row in stale:
        crud.revoke_key(session, key_id=row.id, by=DEMO_ACTOR)
    created = crud.create_tenant_key(
        session, secret=secret, tenant_id=tenant.id, name=DEMO_KEY_NAME, by=DEMO_ACTOR
    )
    return TenantCredentials(tenant.name, tenant.id, tenant.tier, created.row.id, created.key,
                             reused=False)


def _live_key(
    session: Session, tenant: Tenant, kept: dict[str, str], secret: str
) -> ApiKey | None:
    """The kept key's row, if the key still works for this tenant under this secret."""
    key = kept.get("key")
    if not isinstance(key, str) or kept.get("tenant_id") != tenant.id:
        return None
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key, secret)))
    if (
        row is None
        or row.tenant_id != tenant.id
        or row.revoked_at is not None
        or (row.expires_at is not None and row.expires_at <= datetime.now(UTC))
    ):
        return None
    return row


# --------------------------------------------------------------------------- adapters


def adapter_digest(directory: Path) -> str:
    """The registry's content address of a PEFT directory (archive.content_digest)."""
    def file_sha(name: str) -> str:
        return hashlib.sha256((directory / name).read_bytes()).hexdigest()

    return content_digest(file_sha(CONFIG_FILE), file_sha(WEIGHTS_FILE))


async def seed_adapters(
    registry: AdapterRegistry,
    adapters: Sequence[TrainedAdapter],
    tenant_ids: dict[str, str],
) -> list[SeededAdapter]:
    """Upload each adapter through the registry, as POST /admin/adapters does, unless
    its latest ready version already has the same content."""
    seeded: list[SeededAdapter] = []
    for trained in adapters:
        spec = trained.spec
        tenant_id = None if spec.owner is None else tenant_ids[spec.owner]
        digest = await asyncio.to_thread(adapter_digest, trained.path)
        current = await asyncio.to_thread(_latest_ready, registry, spec.name, tenant_id)
        if current is not None and current.sha256 == digest:
            seeded.append(SeededAdapter(spec.name, spec.owner, current.adapter_id,
                                        current.version, uploaded=False))
            continue
        with tempfile.TemporaryDirectory(prefix="demo-upload-") as tmp:
            archive = Path(tmp) / f"{spec.name}.tar.gz"
            await asyncio.to_thread(_pack, trained.path, archive)
            version = await registry.upload(
                archive, name=spec.name, tenant_id=tenant_id, by=DEMO_ACTOR
            )
        logger.info("demo adapter %s uploaded as version %d", spec.name, version.version)
        seeded.append(SeededAdapter(spec.name, spec.owner, version.adapter_id, version.version,
                                    uploaded=True))
    return seeded


def _latest_ready(
    registry: AdapterRegistry, name: str, tenant_id: str | None
) -> VersionView | None:
    owner = SHARED_OWNER if tenant_id is None else tenant_id
    for adapter in registry.list_adapters(owner=owner):
        if adapter.name == name:
            ready = [v for v in adapter.versions if v.status == AdapterStatus.READY]
            return ready[-1] if ready else None
    return None


def _pack(directory: Path, archive: Path) -> None:
    with tarfile.open(archive, "w:gz") as tar:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            tar.add(directory / name, arcname=name)


# ------------------------------------------------------------------------------- all


async def seed_demo(state: AppState, adapters: Sequence[TrainedAdapter]) -> DemoSetup:
    """Tenants, keys and adapters in the app's database and registry (its lifespan must
    be running: uploads register the adapters in its engine)."""
    demo_dir = state.settings.data_dir / "demo"
    tenants = await asyncio.to_thread(seed_tenants, state, demo_dir)
    seeded = await seed_adapters(
        state.registry, adapters, {t.name: t.tenant_id for t in tenants}
    )
    # This replica serves the new keys and versions at once, not at the next refresh.
    await asyncio.to_thread(state.directory.refresh)
    # ... and "ready" is printed once its engine serves them (at a second start they
    # load in the background from the registry's files).
    if not await state.registry.engine_sync.settled(ENGINE_LOAD_WAIT_S):
        logger.warning("the demo adapters were still loading after %.0f s", ENGINE_LOAD_WAIT_S)
    await start_evals(state, adapters, seeded)
    return DemoSetup(tuple(tenants), tuple(seeded))


async def start_evals(
    state: AppState, adapters: Sequence[TrainedAdapter], seeded: Sequence[SeededAdapter]
) -> list[str]:
    """Start each demo adapter's eval set on its latest version, unless that version has
    scored the same set already (or is scoring it now): the scores then show on the
    adapter's page in the admin UI. Returns the ids of the evals started; they run in the
    background, at the engine's lowest priority, while the demo serves."""
    started: list[str] = []
    for trained, adapter in zip(adapters, seeded, strict=True):
        data = await asyncio.to_thread(trained.spec.eval_set.read_bytes)
        digest = hashlib.sha256(data).hexdigest()
        evals = await asyncio.to_thread(state.evals.list_evals, adapter.adapter_id)
        if any(e.version == adapter.version and e.set_sha256 == digest
               and e.status != EvalStatus.FAILED for e in evals):
            continue
        try:
            view = await state.evals.start(adapter.adapter_id, data, version=adapter.version,
                                           by=DEMO_ACTOR)
        except ServiceError as e:  # e.g. not served yet: the demo serves on without it
            logger.warning("demo adapter %s: its eval did not start: %s", adapter.name, e)
            continue
        started.append(view.id)
    return started

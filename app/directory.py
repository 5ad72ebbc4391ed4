"""What the hot path knows of the database: API keys, tenants and ready adapter versions,
held in memory and refreshed from the database in the background.

A request authenticates and resolves its model with dictionary lookups only, never a
SQL query. Every replica polls for rows changed since it last looked, so a revocation,
a disabled tenant or a new adapter version made on any replica reaches all of them
within `refresh_interval_s` plus the time of one query: refreshes start at a fixed rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from app.core.errors import Unauthenticated
from app.core.principal import REGISTRY_ENGINE_PREFIX, AdapterRef, Principal, TenantInfo
from app.core.security import DISPLAY_PREFIX_CHARS, hash_key, well_formed
from app.directory_snapshot import EMPTY, Changes, Snapshot, merge, read_changes
from app.tables import Scope, utcnow

logger = logging.getLogger(__name__)

# NOTE: each refresh re-reads the rows changed in the last few seconds before its
# watermark: replicas' clocks differ, and a transaction may commit after another one
# that stamped a later updated_at. Re-reading a handful of rows is cheap; missing one
# would leave a revoked key working.
REFRESH_OVERLAP = timedelta(seconds=5)
# A full reload now and then repairs anything a refresh could still miss (a
# transaction that stayed open for longer than the overlap).
FULL_RELOAD_INTERVAL_S = 300.0
# The bootstrap admin key may be any string; longer ones are not even hashed.
_MAX_BOOTSTRAP_KEY_CHARS = 1024
ALL_SCOPES = frozenset(s.value for s in Scope)

# (versions that became ready, versions that went away); what it returns is ignored.
AdapterListener = Callable[[list[AdapterRef], list[AdapterRef]], object]


def _unauthorized(message: str) -> Unauthenticated:
    return Unauthenticated(message, code="invalid_api_key")


def _masked(key: str) -> str:
    """Enough of a well-formed key to recognise it, far too little to use it."""
    return f"{key[:DISPLAY_PREFIX_CHARS]}***{key[-4:]}"


class Directory:
    """Keys, tenants and ready adapter versions in memory, refreshed from the database.

    Readers (`authenticate`, `tenant`, `resolve_adapter`, ...) run on the event loop and
    read one immutable snapshot each; `load` and `refresh` run in a thread and swap in a
    new snapshot.
    """

    def __init__(
        self,
        db: sessionmaker[Session],
        *,
        secret: str,
        admin_key: str | None,
        refresh_interval_s: float,
    ) -> None:
        self._db = db
        self._secret = secret
        self._admin_hash = hash_key(admin_key, secret) if admin_key else None
        self.refresh_interval_s = refresh_interval_s
        self._snap = EMPTY
        self._watermark: datetime | None = None
        self._listeners: list[AdapterListener] = []
        # Serialises writers (the background refresh and routes refreshing after a write).
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        self._last_ok: float | None = None  # time.monotonic()
        self._last_full_load = 0.0
        self.last_refresh_ok = False

    @property
    def secret(self) -> str:
        """The key-hashing secret: new keys must be hashed with the same one."""
        return self._secret

    # ------------------------------------------------------------------ loading

    def load(self) -> None:
        """Read everything (blocking: call it in a thread from async code)."""
        with self._lock:
            self._load_locked()

    def refresh(self) -> None:
        """Read the rows changed since the last load or refresh (blocking)."""
        with self._lock:
            if self._watermark is None:
                self._load_locked()
                return
            started = utcnow()
            changes = self._query(self._watermark - REFRESH_OVERLAP)
            self._install(merge(self._snap, changes, full=False), changes, started)

    def refresh_after_write(self) -> None:
        """After a committed change: this replica sees it now, not at the next poll.
        Best effort (blocking): if the read fails, the background refresh picks it up."""
        try:
            self.refresh()
        except Exception:
            logger.warning("directory refresh after a committed change failed", exc_info=True)

    def _load_locked(self) -> None:
        started = utcnow()
        changes = self._query(None)
        self._install(merge(EMPTY, changes, full=True), changes, started)
        self._last_full_load = time.monotonic()

    def _query(self, since: datetime | None) -> Changes:
        try:
            with self._db() as session:
                return read_changes(session, since)
        except Exception:
            self.last_refresh_ok = False
            raise

    def _install(self, new: Snapshot, changes: Changes, started: datetime) -> None:
        old, self._snap = self._snap, new
        # The newest stamp read, but never past this replica's clock: a writer whose clock
        # runs ahead must not make us skip rows stamped by the others.
        candidates = [w for w in (self._watermark, changes.newest) if w is not None]
        if candidates:
            self._watermark = min(max(candidates), started)
        else:
            self._watermark = started - REFRESH_OVERLAP
        self.last_refresh_ok = True
        self._last_ok = time.monotonic()
        if new.ready is old.ready:
            return
        added = [r for vid, r in new.ready.items() if old.ready.get(vid) != r]
        removed = [r for vid, r in old.ready.items() if new.ready.get(vid) != r]
        if added or removed:
            self._notify(list(self._listeners), added, removed)

    def add_listener(self, callback: AdapterListener) -> None:
        """`callback(added, removed)` whenever a load or refresh changes the set of ready
        versions. A listener added after a load is first told of every version ready
        now (as added), so that it never misses one whichever order things start in.

        It runs on the thread that loaded, under the refresh lock, in order: it must not
        block (hand work to a loop with `call_soon_threadsafe`) nor call `refresh`."""
        with self._lock:
            self._listeners.append(callback)
            current = self.ready_versions()
            if current:
                self._notify([callback], current, [])

    def _notify(
        self, listeners: list[AdapterListener], added: list[AdapterRef], removed: list[AdapterRef]
    ) -> None:
        for listener in listeners:
            try:
                listener(added, removed)
            except Exception:
                logger.exception("adapter listener %r failed", listener)

    # --------------------------------------------------------------- background

    async def start(self) -> None:
        """Load everything, then refresh every `refresh_interval_s` until stop()."""
        await asyncio.to_thread(self.load)
        self._task = asyncio.create_task(self._run(), name="directory-refresh")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        failing = False
        # Fixed rate: a refresh starts every interval, not an interval after the last
        # one ended, so a slow query does not push every later change back by its time.
        # A refresh that overran its interval is followed after a tenth of one (a slow
        # database is not queried back to back), never two at once.
        next_start = time.monotonic()
        while True:
            next_start = max(next_start + self.refresh_interval_s,
                             time.monotonic() + self.refresh_interval_s / 10)
            await asyncio.sleep(next_start - time.monotonic())
            full = time.monotonic() - self._last_full_load >= FULL_RELOAD_INTERVAL_S
            try:
                await asyncio.to_thread(self.load if full else self.refresh)
            except Exception:
                # NOTE: keep serving the last good snapshot (a database outage must not
                # log everybody out); /ready reports it through last_refresh_ok.
                logger.warning(
                    "directory refresh failed; serving the snapshot of %.1f s ago",
                    self.seconds_since_refresh(),
                    exc_info=not failing,
                )
                failing = True
            else:
                if failing:
                    logger.info("directory refresh recovered")
                failing = False

    def seconds_since_refresh(self) -> float:
        """Since the last successful load or refresh (inf before the first)."""
        return math.inf if self._last_ok is None else time.monotonic() - self._last_ok

    # ------------------------------------------------------------------ readers

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller of an `Authorization` header; 401 `invalid_api_key` otherwise."""
        if authorization is None or not authorization.strip():
            raise _unauthorized(
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized(
                "The Authorization header must use Bearer auth "
                "(i.e. Authorization: Bearer YOUR_KEY)."
            )
        if not well_formed(token):
            # The bootstrap key is the operator's own string: the only thing a malformed
            # key may still be. Without one, nothing is hashed or looked up.
            if (
                self._admin_hash is not None
                and len(token) <= _MAX_BOOTSTRAP_KEY_CHARS
                and hmac.compare_digest(hash_key(token, self._secret), self._admin_hash)
            ):
                return _BOOTSTRAP
            raise _unauthorized(
                "The API key provided is malformed: loraplex keys look like "
                "lpx_t_... (tenants) or lpx_a_... (admins), 45 characters with a checksum. "
                "Check that it was copied whole."
            )
        digest = hash_key(token, self._secret)
        if self._admin_hash is not None and hmac.compare_digest(digest, self._admin_hash):
            return _BOOTSTRAP
        snap = self._snap
        # NOTE: a dict lookup on the HMAC leaks nothing useful through its timing: the
        # caller cannot choose the hash it probes with.
        key = snap.keys.get(digest)
        if key is None or not (key.is_admin or key.tenant_id is not None):
            raise _unauthorized(
                f"Incorrect API key provided: {_masked(token)}. Check the key, or ask "
                "your administrator for a new one."
            )
        if key.revoked:
            raise _unauthorized(f"The API key {_masked(token)} was revoked.")
        if key.expires_at is not None and key.expires_at <= datetime.now(UTC):
            raise _unauthorized(
                f"The API key {_masked(token)} expired at {key.expires_at.isoformat()}."
            )
        if key.is_admin:
            return Principal(
                actor=key.id, key_id=key.id, tenant=None, is_admin=True, scopes=ALL_SCOPES
            )
        assert key.tenant_id is not None
        tenant = snap.tenants.get(key.tenant_id)
        if tenant is None or tenant.deleted:
            raise _unauthorized("The account of this API key was deleted.")
        if tenant.info.disabled:
            raise _unauthorized("The account of this API key is disabled.")
        return Principal(
            actor=key.id, key_id=key.id, tenant=tenant.info, is_admin=False, scopes=key.scopes
        )

    def tenant(self, tenant_id: str) -> TenantInfo | None:
        """A tenant that is not deleted (disabled ones too: `.disabled` says so)."""
        row = self._snap.tenants.get(tenant_id)
        return None if row is None or row.deleted else row.info

    def resolve_adapter(self, tenant_id: str | None, model: str) -> AdapterRef | None:
        """`name` (its current version: the newest ready one not staged) or `name@N`, among
        the tenant's own adapters, then the shared ones; None for anything else, other
        tenants' adapters included.

        NOTE: a tenant's own adapter shadows a shared one of the same name, `@N` too: a
        name means one line of versions to a tenant, as `visible_adapters` lists it."""
        name, sep, suffix = model.rpartition("@")
        version: int | None = None
        if sep and suffix.isdigit() and suffix.isascii():
            version = int(suffix)
        else:
            name = model
        lines = self._snap.lines
        owner: str | None = tenant_id
        line = lines.get((tenant_id, name)) if tenant_id is not None else None
        if line is None:
            owner, line = None, lines.get((None, name))
        if line is None:
            return None
        if version is None:
            return self._snap.current.get((owner, name))  # None: every version staged
        for ref in line:
            if ref.version == version:
                return ref
        return None

    def model_name(self, engine_name: str) -> str | None:
        """What clients send in `model` for an engine adapter: `name` for a registry line's
        current version, `name@N` for another one, None for a version no longer ready; an
        adapter from outside the registry (`--lora-modules`) by its own name."""
        if not engine_name.startswith(REGISTRY_ENGINE_PREFIX):
            return engine_name
        ref = self._snap.ready.get(engine_name.removeprefix(REGISTRY_ENGINE_PREFIX))
        if ref is None:
            return None
        current = self._snap.current.get((ref.tenant_id, ref.name))
        return ref.name if current is ref else f"{ref.name}@{ref.version}"

    def visible_adapters(self, tenant_id: str | None) -> list[AdapterRef]:
        """The current version of each name the tenant can use, sorted by name."""
        current = self._snap.current
        latest: dict[str, AdapterRef | None] = {}
        for owner, name in self._snap.lines:
            if owner is None:
                latest.setdefault(name, current.get((None, name)))
            elif owner == tenant_id:  # shadows the shared line, even when all staged
                latest[name] = current.get((owner, name))
        return [ref for name in sorted(latest) if (ref := latest[name]) is not None]

    def ready_ref(self, version_id: str) -> AdapterRef | None:
        """A ready version by its id; None if it is not (or no longer) ready."""
        return self._snap.ready.get(version_id)

    def ready_versions(self) -> list[AdapterRef]:
        """Every ready version, of every tenant and shared."""
        return sorted(
            self._snap.ready.values(),
            key=lambda r: (r.tenant_id or "", r.name, r.version),
        )


_BOOTSTRAP = Principal(
    actor="bootstrap", key_id=None, tenant=None, is_admin=True, scopes=ALL_SCOPES
)

"""AdapterRegistry: uploads become stored files, database versions and engine adapters;
deletes take them away; every replica's engine follows the ready versions.

An upload goes: archive checks (archive.py) -> a `validating` version row -> the files
moved to their content address (store.py) -> the engine's own validation, which also
registers the version on this replica -> `ready` with a report, or `failed` with the
reason. Other replicas register it when their directory reports it (sync.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from app.audit import AuditContext
from app.core.config import Settings
from app.core.errors import (
    Conflict,
    InvalidInput,
    ServiceError,
    TooLarge,
    Unavailable,
    Unprocessable,
)
from app.core.principal import AdapterRef
from app.db import session_scope
from app.registry import records
from app.registry.archive import (
    MAX_MEMBERS,
    ArchiveError,
    UnpackedAdapter,
    too_large,
    unpack_adapter,
)
from app.registry.object_store import (
    BlobMissing,
    ObjectStore,
    StoreUnavailable,
    TooBig,
    TooMany,
)
from app.registry.store import make_store
from app.registry.sync import EngineSync
from app.registry.views import AdapterView, SyncResult, VersionView, check_adapter_name
from app.tables import AdapterStatus
from engine.client import EngineClient, EngineUnavailable
from engine.lora.weights import AdapterError

log = logging.getLogger("loraplex.registry")

# READMEs and the like, unpacked or skipped, on top of the engine's bound.
_DOCS_ALLOWANCE = 1024 * 1024
# Uploads a crash left in <data_dir>/tmp/ are removed after this long untouched.
_STALE_TEMP_S = 3600.0
# Concurrent uploads of one name race for the next version number; on SQLite a
# transaction that read before another committed cannot write ("database is locked").
_INSERT_ATTEMPTS = 8


class AdapterRegistry:
    def __init__(
        self,
        db: sessionmaker[Session],
        engine: EngineClient,
        settings: Settings,
        *,
        file_grace_s: float | None = None,
    ) -> None:
        """file_grace_s: how long a deleted version's files stay for requests still
        running on it (default: the request timeout; 0 removes them at once)."""
        self.db = db
        self.engine = engine
        self.settings = settings
        self.store = make_store(settings, engine)
        self.engine_sync = EngineSync(engine, self.store.ensure)
        self._grace_s = settings.request_timeout_s if file_grace_s is None else file_grace_s
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """At startup, on the serving event loop: engine syncs asked for before now run
        on it from now on, and files a crash left behind are removed (in the background)."""
        await asyncio.to_thread(self.store.ensure_dirs)
        await asyncio.to_thread(self.store.remove_stale_temp, _STALE_TEMP_S)
        self.engine_sync.start(asyncio.get_running_loop())
        self._spawn(asyncio.to_thread(self._collect_orphans_at_start))

    async def stop(self) -> None:
        """Syncs asked for from now on wait for the next start; deletes' pending file
        removals are dropped (collect_orphans at the next start catches them)."""
        self.engine_sync.stop()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def on_versions_changed(
        self, added: Sequence[AdapterRef], removed: Sequence[AdapterRef]
    ) -> concurrent.futures.Future[SyncResult]:
        """The directory's listener (any thread): register the ready versions that
        appeared into this replica's engine, remove those that went (see EngineSync)."""
        return self.engine_sync.on_versions_changed(added, removed)

    # -- limits --------------------------------------------------------------------------

    def unpacked_limit(self) -> int:
        """Bytes an archive may unpack to: what a valid adapter can weigh, plus docs."""
        return self.engine.max_adapter_bytes() + _DOCS_ALLOWANCE

    def upload_limit(self) -> int:
        """Bytes an uploaded archive may have: the setting, or what packing the largest
        valid adapter can take (compression grows incompressible data by a small
        fraction plus headers), whichever is smaller."""
        unpacked = self.unpacked_limit()
        return min(self.settings.max_upload_bytes, unpacked + unpacked // 256 + 64 * 1024)

    # -- uploads -------------------------------------------------------------------------

    async def upload(
        self,
        archive: Path,
        *,
        name: str,
        tenant_id: str | None,
        by: AuditContext,
        enforce_quota: bool = False,
        param: str = "file",
        stage: bool = False,
    ) -> VersionView:
        """Store, record and validate an uploaded archive (or an adapter directory on this
        machine, an import) as the next version of `name` (tenant_id None: shared). The
        caller owns (and removes) `archive`; `param` names it in refusals. Refusals:
        InvalidInput or TooLarge for a refused archive (no rows), NotFound for an unknown
        tenant, Forbidden `max_adapters_exceeded`, Unprocessable `invalid_adapter` (the
        version is kept as `failed` with the reason), Unavailable `overloaded` when no
        engine can validate it now (no rows, no files: the upload can be retried as is)."""
        check_adapter_name(name, base_model_id=self.engine.model_id)
        if tenant_id is not None:
            # Refused before unpacking: what the insert would refuse anyway.
            await asyncio.to_thread(self._check_owner, tenant_id, name, enforce_quota)
        # NOTE: shielded, so that a caller cancelled half-way (client gone, drain) can
        # leave neither a version `validating` for ever nor an unpacked copy behind.
        task = self._spawn(
            self._register(archive, name, tenant_id, by, enforce_quota, param, stage)
        )
        return await asyncio.shield(task)

    async def import_url(
        self, url: str, *, name: str, tenant_id: str | None, by: AuditContext,
        param: str = "source",
    ) -> VersionView:
        """An upload whose files come from an object store prefix (`s3://bucket/path/`)
        instead of a request body; refusals as upload's and imported()'s."""
        check_adapter_name(name, base_model_id=self.engine.model_id)
        async with self.imported(url, param=param) as directory:
            return await self.upload(directory, name=name, tenant_id=tenant_id, by=by,
                                     param=param)

    @asynccontextmanager
    async def imported(self, url: str, *, param: str) -> AsyncIterator[Path]:
        """The objects under `url`, read with this server's AWS credentials, in a local
        directory for as long as the context lasts (for upload(), which checks them as
        any upload), read under the upload's size bound. InvalidInput for a URL that is
        not one or an empty prefix, TooLarge, Unavailable when the store cannot be
        reached; nothing is kept."""
        try:
            reader = self.store.remote or ObjectStore(url)
        except ValueError as e:
            raise InvalidInput(str(e), param=param) from None
        await asyncio.to_thread(self.store.ensure_dirs)
        dest = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="import-",
                                            dir=self.store.tmp))
        try:
            try:
                await asyncio.to_thread(
                    reader.download_prefix, url, dest, max_bytes=self.unpacked_limit(),
                    max_members=MAX_MEMBERS,
                )
            except (ValueError, BlobMissing) as e:
                raise InvalidInput(f"Cannot import {url}: {e}.", param=param) from None
            except TooMany as e:
                raise InvalidInput(f"Cannot import {url}: it holds {e}; an adapter is two "
                                   "files and a few docs.", param=param) from None
            except TooBig:
                raise TooLarge(too_large(self.unpacked_limit()).message, param=param,
                               code="archive_too_large") from None
            except StoreUnavailable as e:
                raise Unavailable(f"Cannot import {url} right now: {e}.",
                                  retry_after_s=self.settings.retry_after_s) from None
            yield dest
        finally:
            await asyncio.to_thread(shutil.rmtree, dest, True)

    async def _register(
        self,
        archive: Path,
        name: str,
        tenant_id: str | None,
        by: AuditContext,
        enforce_quota: bool,
        param: str,
        stage: bool = False,
    ) -> VersionView:
        try:
            unpacked = await asyncio.to_thread(
                unpack_adapter, archive, self.store.tmp, max_unpacked_bytes=self.unpacked_limit()
            )
        except ArchiveError as e:
            refusal = TooLarge if e.status_code == 413 else InvalidInput
            raise refusal(e.message, code=e.code, param=param) from None
        path = self.store.path(unpacked.sha256)
        try:
            version = await asyncio.to_thread(
                self._insert_version, unpacked, name, tenant_id, by, enforce_quota, stage
            )
            try:
                await asyncio.to_thread(self.store.put, unpacked.directory, unpacked.sha256)
                info = await self.engine.add_adapter(version.engine_name, str(path))
            except StoreUnavailable as e:
                log.warning("upload of %r withdrawn: %s", name, e)
                await self._withdraw(version, by)
                raise Unavailable(
                    f"The adapter store cannot take the adapter right now ({e}); retry the "
                    "upload shortly.",
                    retry_after_s=self.settings.retry_after_s,
                ) from None
            except AdapterError as e:
                reason = _public_reason(str(e), path)
                await self._finish(version.id, AdapterStatus.FAILED, {"error": reason})
                await self._collect([unpacked.sha256])
                raise Unprocessable(reason, param=param, code="invalid_adapter") from None
            except EngineUnavailable as e:
                # NOTE: undone rather than kept `validating` for a worker to come: what a
                # version means is settled when its upload answers.
                log.warning("upload of %r withdrawn: %s", name, e)
                await self._withdraw(version, by)
                raise Unavailable(
                    "No engine worker can validate the adapter right now; retry the upload "
                    "shortly.",
                    retry_after_s=self.settings.retry_after_s,
                ) from None
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._finish(
                        version.id, AdapterStatus.FAILED, {"error": "validation did not complete"}
                    )
                raise
        finally:
            shutil.rmtree(unpacked.directory, ignore_errors=True)  # already gone if stored
        report = {
            "rank": info.rank,
            "alpha": info.alpha,
            "use_rslora": info.use_rslora,
            "target_modules": list(info.target_modules),
            "size_bytes": unpacked.size_bytes,
            "config_bytes": unpacked.config_bytes,
            "weights_bytes": unpacked.weights_bytes,
            "memory_bytes": info.size_bytes,
        }
        try:
            done = await self._finish(version.id, AdapterStatus.READY, report)
        except BaseException:
            # Not recorded as ready: not served either.
            await self.engine.remove_adapter(version.engine_name)
            raise
        if done is None:
            await self.engine.remove_adapter(version.engine_name)
            raise Conflict(
                f"The adapter '{name}' was deleted while its version {version.version} was "
                "being validated."
            )
        return done

    def _check_owner(self, tenant_id: str, name: str, enforce_quota: bool) -> None:
        with session_scope(self.db) as s:
            tenant = records.live_tenant(s, tenant_id)
            if enforce_quota:
                records.check_quota(s, tenant, name)

    def _insert_version(
        self,
        unpacked: UnpackedAdapter,
        name: str,
        tenant_id: str | None,
        by: AuditContext,
        enforce_quota: bool,
        stage: bool = False,
    ) -> VersionView:
        for attempt in range(_INSERT_ATTEMPTS):
            try:
                with session_scope(self.db) as s:
                    return records.insert_version(
                        s, unpacked, name=name, tenant_id=tenant_id, by=by,
                        enforce_quota=enforce_quota, stage=stage,
                    )
            except (IntegrityError, OperationalError) as exc:
                if attempt == _INSERT_ATTEMPTS - 1 or not _is_race(exc):
                    raise
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")

    async def _withdraw(self, version: VersionView, by: AuditContext) -> None:
        """Forget a version no engine validated: its rows, the engine's note of it, and
        its files unless another version has the same content."""

        def withdraw() -> None:
            with session_scope(self.db) as s:
                records.withdraw_version(s, version.id, by=by)

        await asyncio.to_thread(withdraw)
        await self.engine.remove_adapter(version.engine_name)
        if version.sha256 is not None:
            await self._collect([version.sha256])

    async def _finish(
        self, version_id: str, status: AdapterStatus, report: dict[str, object]
    ) -> VersionView | None:
        def finish() -> VersionView | None:
            with session_scope(self.db) as s:
                return records.finish_version(s, version_id, status, report)

        return await asyncio.to_thread(finish)

    # -- deletes -------------------------------------------------------------------------

    async def delete(self, adapter_id: str, *, owner: str | None, by: AuditContext) -> AdapterView:
        """Delete an adapter and all its versions. owner: the caller's tenant id (or
        "shared"), None for any owner (admin); anyone else's adapter is a 404. Requests
        running on it finish; its files go after the grace period unless another
        version has the same content."""

        def mark() -> tuple[AdapterView, list[str]]:
            with session_scope(self.db) as s:
                return records.mark_deleted(s, adapter_id, owner=owner, by=by)

        view, ready = await asyncio.to_thread(mark)
        for engine_name in ready:
            await self.engine.remove_adapter(engine_name)
        digests = sorted({v.sha256 for v in view.versions if v.sha256 is not None})
        if self._grace_s <= 0:
            await self._collect(digests)
        else:
            self._spawn(self._collect_later(digests, self._grace_s))
        return view

    # -- stored files --------------------------------------------------------------------

    async def _collect_later(self, digests: list[str], delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self._collect(digests)

    async def _collect(self, digests: Sequence[str]) -> list[str]:
        if not digests:
            return []
        return await asyncio.to_thread(self._remove_unused, set(digests), None)

    def _remove_unused(self, digests: set[str], changed_after: datetime | None) -> list[str]:
        # NOTE: under the store's lock: an upload of the same content stores it (after
        # committing its version) under that lock too, so it is either seen here as in
        # use or stores the files again afterwards.
        with self.store.locked():
            with session_scope(self.db) as s:
                in_use = records.digests_in_use(s, digests, changed_after=changed_after)
            return [d for d in sorted(digests - in_use) if self.store.remove(d)]

    def _collect_orphans_at_start(self) -> None:
        try:
            self.collect_orphans()
        except StoreUnavailable as e:
            log.warning("orphaned adapter files not collected: %s", e)

    def collect_orphans(self) -> list[str]:
        """Remove stored files no version uses, left by a crash or by a shutdown within
        a delete's grace period; anything touched within the grace period stays."""
        cutoff = time.time() - self._grace_s
        since = datetime.now(UTC) - timedelta(seconds=self._grace_s)
        old = {d for d in self.store.digests() if self.store.modified_at(d) < cutoff}
        removed = self._remove_unused(old, since) if old else []
        remote = self.store.remote
        if remote is None:
            return removed
        # NOTE: the object store's own, by the time each was last uploaded: an upload of
        # the same content on another node writes it again, so what it just stored is
        # within the grace period here.
        old = {d for d, at in remote.digests().items() if at.timestamp() < cutoff}
        with session_scope(self.db) as s:
            in_use = records.digests_in_use(s, old, changed_after=since)
        for digest in sorted(old - in_use):
            remote.delete(digest)
            removed.append(digest)
        return sorted(set(removed))

    # -- reading -------------------------------------------------------------------------

    def list_adapters(
        self, *, owner: str | None = None, include_deleted: bool = False
    ) -> list[AdapterView]:
        """owner: a tenant id or "shared"; None lists every owner's. Oldest first."""
        with session_scope(self.db) as s:
            return records.list_adapters(s, owner=owner, include_deleted=include_deleted)

    def get_adapter(self, adapter_id: str, *, owner: str | None = None) -> AdapterView:
        """404 for an unknown id and, with owner, for anyone else's or a deleted one."""
        with session_scope(self.db) as s:
            return records.get_adapter(s, adapter_id, owner=owner)

    # -- the promotion gate --------------------------------------------------------------

    def promote(self, adapter_id: str, version: int, *, owner: str | None = None,
                by: AuditContext, reason: str = "promoted") -> AdapterView:
        """A staged version becomes current (records.promote_version)."""
        with session_scope(self.db) as s:
            return records.promote_version(s, adapter_id, version, owner=owner, by=by,
                                           reason=reason)

    def rollback(self, adapter_id: str, *, owner: str | None = None,
                 by: AuditContext) -> AdapterView:
        """The current version goes back to staged (records.rollback_version)."""
        with session_scope(self.db) as s:
            return records.rollback_version(s, adapter_id, owner=owner, by=by)

    def set_gate(self, adapter_id: str, gate_set: bytes | None, threshold: float | None, *,
                 by: AuditContext) -> AdapterView:
        with session_scope(self.db) as s:
            return records.set_gate(s, adapter_id, gate_set, threshold, by=by)

    def gate_of(self, adapter_id: str) -> tuple[bytes | None, float | None]:
        """The adapter's gate eval set and threshold; (None, None) without a gate."""
        with session_scope(self.db) as s:
            return records.gate_of(s, adapter_id)

    # -- internals -----------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, ServiceError):
            log.error("adapter registry task failed", exc_info=exc)


def _public_reason(message: str, path: Path) -> str:
    """The engine's reason without the server's directories in it."""
    return message.replace(f"{path}/", "").replace(str(path), "the adapter")


def _is_race(exc: IntegrityError | OperationalError) -> bool:
    return isinstance(exc, IntegrityError) or "database is locked" in str(exc)

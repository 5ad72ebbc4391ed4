"""Keeping one replica's engine in step with the ready adapter versions of the database.

The directory's refresh (a worker thread) reports the ready versions that appeared and
disappeared, and at start all of them; the engine calls run on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from app.core.principal import AdapterRef
from app.registry.views import SyncResult
from engine.client import EngineClient

log = logging.getLogger("loraplex.registry")

_Future = concurrent.futures.Future


class EngineSync:
    def __init__(self, engine: EngineClient, files: Callable[[str], Path]) -> None:
        """files: sha256 -> the stored adapter directory (blocking: it may fetch it from
        the object store)."""
        self.engine = engine
        self._files = files
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        # (added, removed, future) asked for before start()
        self._pending: list[tuple[list[AdapterRef], list[AdapterRef], _Future[SyncResult]]] = []
        self._inflight: set[_Future[SyncResult]] = set()
        self._sync_lock = asyncio.Lock()
        # engine name -> the version to retry, and why it failed last
        self._failed: dict[str, tuple[AdapterRef, str]] = {}
        # engine name -> its load running now (by a sync, or for a request)
        self._loading: dict[str, asyncio.Task[str | None]] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on syncs run on `loop`; those asked for before run now."""
        with self._lock:
            self._loop = loop
            pending, self._pending = self._pending, []
        for added, removed, future in pending:
            inner = self._schedule(loop, added, removed)
            inner.add_done_callback(functools.partial(_copy_outcome, future))

    def stop(self) -> None:
        """Later calls queue again (until the next start)."""
        with self._lock:
            self._loop = None

    @property
    def failed(self) -> dict[str, AdapterRef]:
        """Versions that could not be loaded here (tried again on every call)."""
        return {name: ref for name, (ref, _) in self._failed.items()}

    def retry(self, engine_name: str) -> str | None:
        """Why a version could not be loaded here, None if it did not fail; a failed one
        is tried again now (in the background), so that a request for it, refused with
        that reason, may be retried."""
        failed = self._failed.get(engine_name)
        if failed is None:
            return None
        self.on_versions_changed((), ())
        return failed[1]

    async def settled(self, timeout_s: float) -> bool:
        """Wait (on the serving loop) until every sync asked for so far has run, at most
        `timeout_s`; False if some were still running then (or are queued before start)."""
        with self._lock:
            if self._pending:
                return False
            running = [asyncio.wrap_future(f) for f in self._inflight if not f.done()]
        if not running:
            return True
        _, late = await asyncio.wait(running, timeout=timeout_s)
        return not late

    async def ensure_loaded(self, ref: AdapterRef) -> str | None:
        """On the serving loop, for a request: `ref` loaded into the engine now, ahead of
        the versions a sync still has queued (a replica starting with hundreds), or the
        load already running for it awaited; None once served, else why it failed."""
        if self.engine.get_adapter(ref.engine_name) is not None:
            return None
        return await self._load(ref)

    async def _load(self, ref: AdapterRef) -> str | None:
        """One load per version at a time, whoever asks (a sync, requests)."""
        name = ref.engine_name
        task = self._loading.get(name)
        if task is None:
            task = asyncio.ensure_future(self._fetch_and_add(ref))
            self._loading[name] = task
            task.add_done_callback(functools.partial(self._loaded, name))
        # NOTE: shielded: a request whose client left must not cancel the load.
        return await asyncio.shield(task)

    def _loaded(self, name: str, task: asyncio.Task[str | None]) -> None:
        if self._loading.get(name) is task:
            del self._loading[name]

    async def _fetch_and_add(self, ref: AdapterRef) -> str | None:
        name = ref.engine_name
        try:
            files = await asyncio.to_thread(self._files, ref.sha256)
            await self.engine.add_adapter(name, str(files))
        except Exception as e:
            # NOTE: one version this replica cannot load must not stop the others.
            log.warning("adapter %s@%d (%s) not loaded on this replica: %s",
                        ref.name, ref.version, name, e)
            self._failed[name] = (ref, str(e))
            return str(e)
        self._failed.pop(name, None)
        return None

    def on_versions_changed(
        self, added: Sequence[AdapterRef], removed: Sequence[AdapterRef]
    ) -> _Future[SyncResult]:
        """Thread-safe and non-blocking; the future says what was done. Do not wait on it
        from the event loop's own thread."""
        with self._lock:
            loop = self._loop
            if loop is None:
                future: _Future[SyncResult] = _Future()
                self._pending.append((list(added), list(removed), future))
                return future
        return self._schedule(loop, list(added), list(removed))

    def _schedule(
        self, loop: asyncio.AbstractEventLoop, added: list[AdapterRef], removed: list[AdapterRef]
    ) -> _Future[SyncResult]:
        future = asyncio.run_coroutine_threadsafe(self.sync(added, removed), loop)
        with self._lock:
            self._inflight.add(future)  # a strong reference until done
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: _Future[SyncResult]) -> None:
        with self._lock:
            self._inflight.discard(future)

    async def sync(self, added: Sequence[AdapterRef], removed: Sequence[AdapterRef]) -> SyncResult:
        """Idempotent: names the engine already serves (or no longer serves) are skipped;
        versions that failed to load here are tried again on the next call."""
        done_added: list[str] = []
        done_removed: list[str] = []
        failed: dict[str, str] = {}
        async with self._sync_lock:
            gone = {ref.engine_name for ref in removed}
            for ref in removed:
                self._failed.pop(ref.engine_name, None)
                if self.engine.get_adapter(ref.engine_name) is not None:
                    await self.engine.remove_adapter(ref.engine_name)
                    done_removed.append(ref.engine_name)
            todo = {ref.engine_name: ref for ref in [*self.failed.values(), *added]}
            for name, ref in todo.items():
                if name in gone or self.engine.get_adapter(name) is not None:
                    self._failed.pop(name, None)
                    continue
                error = await self._load(ref)
                if error is None:
                    done_added.append(name)
                else:
                    failed[name] = error
        return SyncResult(added=tuple(done_added), removed=tuple(done_removed), failed=failed)


def _copy_outcome(future: _Future[SyncResult], done: _Future[SyncResult]) -> None:
    if done.cancelled():
        future.cancel()
    elif (exc := done.exception()) is not None:
        future.set_exception(exc)
    else:
        future.set_result(done.result())

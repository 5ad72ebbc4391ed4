"""The adapters a gateway serves, and which workers have them registered.

`add` validates on one worker (the engine's own validation, which also registers it
there) and remembers the adapter's path; `ensure_on` registers it on any other worker the
first time a request for it is routed there; `remove` takes it off every worker that has
it. Paths go over the wire relative to the shared data directory.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.client import AdapterInfo
from engine.errors import AdapterError, NoWorkerAvailable
from engine.remote.calls import AdapterRefused, WorkerFailed, post, register_adapter
from engine.remote.protocol import REMOVE_ADAPTER_PATH
from engine.remote.routing import rendezvous_order
from engine.remote.workers import KnownWorker, WorkerPool

log = logging.getLogger("loraplex.gateway")


@dataclass(slots=True)
class RemoteAdapter:
    path: str  # as sent to workers: relative to the shared data directory when inside it
    info: AdapterInfo | None  # None: no worker could validate it yet


class RemoteAdapters:
    def __init__(
        self, http: httpx.AsyncClient, pool: WorkerPool, data_dir: Path, *, max_attempts: int
    ) -> None:
        self._http = http
        self._pool = pool
        self._data_dir = data_dir.resolve()
        self._max_attempts = max_attempts
        self._adapters: dict[str, RemoteAdapter] = {}
        # (worker id, worker instance, adapter) -> its registration in flight
        self._registrations: dict[tuple[str, str, str], asyncio.Task[AdapterInfo]] = {}

    def knows(self, name: str) -> bool:
        return name in self._adapters

    def get(self, name: str) -> AdapterInfo | None:
        adapter = self._adapters.get(name)
        return None if adapter is None else adapter.info

    def infos(self) -> list[AdapterInfo]:
        # NOTE: list() copies in one step: admin routes read this from worker threads.
        adapters = list(self._adapters.values())
        return sorted((a.info for a in adapters if a.info is not None), key=lambda i: i.name)

    async def add(self, name: str, path: str) -> AdapterInfo:
        """Validate on the worker that has it or, else, the first of its rendezvous order
        (where cold requests for it go). AdapterError when refused; NoWorkerAvailable when
        no worker could answer."""
        wire_path = self.wire_path(path)
        current = self._adapters.get(name)
        if current is not None and current.path == wire_path and current.info is not None:
            return current.info
        if current is not None and current.path != wire_path:
            await self._remove_everywhere(name)  # a new version under an old name
        adapter = RemoteAdapter(path=wire_path, info=None)
        # NOTE: remembered before validation: if no worker can validate it now, requests
        # routed to it still register it lazily (registry versions are validated once).
        self._adapters[name] = adapter
        by_id = {w.worker_id: w for w in self._pool.in_rotation()}
        order = sorted(rendezvous_order(name, by_id), key=lambda w: not by_id[w].has_adapter(name))
        reasons: list[str] = []
        for worker_id in order[: self._max_attempts]:
            try:
                adapter.info = await register_adapter(self._http, by_id[worker_id], name, wire_path)
            except AdapterRefused as exc:
                if self._adapters.get(name) is adapter:
                    del self._adapters[name]
                raise AdapterError(str(exc)) from None
            except WorkerFailed as exc:
                if exc.suspend:
                    self._pool.suspend(worker_id, str(exc))
                reasons.append(f"{worker_id}: {exc}")
                continue
            return adapter.info
        detail = "; ".join(reasons) or "no worker is in rotation"
        raise NoWorkerAvailable(f"no worker could validate adapter {name!r} ({detail})")

    async def remove(self, name: str) -> bool:
        known = self._adapters.pop(name, None) is not None
        await self._remove_everywhere(name)
        return known

    async def ensure_on(self, worker: KnownWorker, name: str, *, force: bool = False) -> None:
        """Register a known adapter on `worker` unless it has it (force: whatever its
        heartbeat says); one call per worker instance and adapter, however many requests
        wait for it. WorkerFailed when this worker cannot serve it."""
        adapter = self._adapters.get(name)
        if adapter is None or (worker.has_adapter(name) and not force):
            return  # unknown here: the worker answers model_not_found
        key = (worker.worker_id, worker.beat.instance, name)
        task = self._registrations.get(key)
        if task is None:
            task = asyncio.ensure_future(register_adapter(self._http, worker, name, adapter.path))
            self._registrations[key] = task
            task.add_done_callback(lambda _: self._registrations.pop(key, None))
        try:
            # Shielded: a request that goes away must not cancel the others' registration.
            info = await asyncio.shield(task)
        except AdapterRefused as exc:
            raise WorkerFailed(f"adapter refused: {exc}", suspend=False) from None
        if adapter.info is None:
            adapter.info = info

    def wire_path(self, path: str) -> str:
        full = Path(path).resolve()
        if full.is_relative_to(self._data_dir):
            return str(full.relative_to(self._data_dir))
        return str(full)

    async def _remove_everywhere(self, name: str) -> None:
        holders = [w for w in self._pool.all() if w.has_adapter(name)]
        for worker in holders:
            worker.registered.discard(name)
        results = await asyncio.gather(
            *(post(self._http, w, REMOVE_ADAPTER_PATH, {"name": name}) for w in holders),
            return_exceptions=True,
        )
        for worker, result in zip(holders, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("removing adapter %s from worker %s failed: %s",
                            name, worker.worker_id, result)

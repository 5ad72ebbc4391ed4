"""Adapter files on disk, addressed by content: `<data_dir>/adapters/<sha256>/` holds
adapter_config.json and adapter_model.safetensors (see archive.content_digest);
uploads are staged under `<data_dir>/tmp/` and moved in with one rename.

With an object store (object_store.py, `LORAPLEX_ADAPTER_STORE=s3://...`) the files live
there and this directory is the node's cache of them: `put` uploads before it keeps a
local copy, `ensure` fetches (hash-checked) what is not here, and `evict` keeps the
cache under `LORAPLEX_ADAPTER_CACHE_BYTES`, least recently used first, never removing
what the node's engine serves from it (`in_use`).

NOTE: replicas may share the data directory, so adding and removing a digest happen
under an advisory file lock; the caller checks, under the same lock, that no version
still uses a digest before removing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from app.core.config import AdapterStoreSettings
from app.registry.archive import ADAPTER_FILES
from app.registry.object_store import BlobCorrupt, BlobMissing, ObjectStore, StoreUnavailable
from engine.client import EngineClient
from engine.errors import AdapterError, EngineUnavailable

_DIGEST = re.compile(r"[0-9a-f]{64}")


class AdapterStore:
    def __init__(
        self, data_dir: Path, *, remote: ObjectStore | None = None,
        cache_bytes: int | None = None, in_use: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """remote: the object store the files live in (None: this directory is the store);
        cache_bytes: with one, the bound of this directory (None: no bound); in_use: the
        digests the node's engine serves from this directory (never evicted)."""
        self.root = data_dir / "adapters"
        self.tmp = data_dir / "tmp"
        self._lock_path = self.root / ".lock"
        self.remote = remote
        self.cache_bytes = cache_bytes
        self._in_use = in_use

    def ensure_dirs(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        assert _DIGEST.fullmatch(digest), f"not a sha256 digest: {digest!r}"
        return self.root / digest

    def has(self, digest: str) -> bool:
        path = self.path(digest)
        return all((path / name).is_file() for name in ADAPTER_FILES)

    def modified_at(self, digest: str) -> float:
        """When a stored digest was last written (unix seconds); +inf if it is gone."""
        try:
            return self.path(digest).stat().st_mtime
        except FileNotFoundError:
            return math.inf

    def digests(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if _DIGEST.fullmatch(p.name))

    def new_temp_file(self, prefix: str) -> Path:
        """An empty file under tmp/ for the caller to fill (and remove)."""
        self.ensure_dirs()
        fd, name = tempfile.mkstemp(prefix=prefix, dir=self.tmp)
        os.close(fd)
        return Path(name)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive across threads and processes sharing the directory (flock)."""
        self.ensure_dirs()
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def put(self, staged: Path, digest: str) -> Path:
        """Move a staged directory (the two files) to its address; if that content is
        already stored, the staged copy is dropped. Returns the stored directory. With an
        object store the files go there first (StoreUnavailable: nothing was kept)."""
        if self.remote is not None:
            self.remote.upload(digest, staged)
        stored = self._keep(staged, digest)
        self.evict(keep={digest})
        return stored

    def ensure(self, digest: str) -> Path:
        """The local directory of `digest`: as stored here, else fetched from the object
        store (hash-checked) into this cache. BlobMissing where neither has it;
        BlobCorrupt, StoreUnavailable from the object store."""
        path = self.path(digest)
        if self.has(digest):
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to touch
                os.utime(path)  # recently used
            return path
        if self.remote is None:
            raise BlobMissing(f"adapter files {digest[:12]} are not in the adapter store")
        self.ensure_dirs()
        staged = Path(tempfile.mkdtemp(prefix="fetch-", dir=self.tmp))
        try:
            self.remote.download(digest, staged)
            self._keep(staged, digest)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        self.evict(keep={digest})
        return path

    def evict(self, keep: Collection[str] = ()) -> list[str]:
        """With an object store and a bound: remove the least recently used local copies
        until this directory is under cache_bytes, except `keep` and what is in use."""
        if self.remote is None or self.cache_bytes is None:
            return []
        keep = {*keep, *(self._in_use() if self._in_use is not None else ())}
        with self.locked():
            entries = sorted(
                (self.modified_at(d), d, _size(self.path(d))) for d in self.digests()
            )
            total = sum(size for _, _, size in entries)
            removed: list[str] = []
            for _, digest, size in entries:
                if total <= self.cache_bytes:
                    break
                if digest not in keep and self.remove(digest):
                    total -= size
                    removed.append(digest)
        return removed

    def _keep(self, staged: Path, digest: str) -> Path:
        final = self.path(digest)
        with self.locked():
            if self.has(digest):
                shutil.rmtree(staged)
                return final
            if final.exists():  # left half-removed by a crash: replace it
                self._discard(final)
            for name in ADAPTER_FILES:
                (staged / name).chmod(0o444)  # stored content never changes
            os.rename(staged, final)
            _fsync_dir(self.root)
        return final

    def remove(self, digest: str) -> bool:
        """Remove a stored digest; call under locked(), after checking nothing uses it."""
        final = self.path(digest)
        if not final.exists():
            return False
        self._discard(final)
        return True

    def _discard(self, path: Path) -> None:
        # Renamed away first, so the address disappears at once even if rmtree stops half-way.
        trash = Path(tempfile.mkdtemp(prefix="trash-", dir=self.tmp))
        os.rename(path, trash / path.name)
        _fsync_dir(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    def remove_stale_temp(self, older_than_s: float) -> int:
        """Remove tmp/ entries untouched for older_than_s (uploads a crash left behind)."""
        if not self.tmp.is_dir():
            return 0
        cutoff = time.time() - older_than_s
        removed = 0
        for entry in self.tmp.iterdir():
            try:
                if entry.lstat().st_mtime >= cutoff:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed += 1
            except FileNotFoundError:
                continue
        return removed


def _size(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in path.iterdir())
    except FileNotFoundError:
        return 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_store(settings: AdapterStoreSettings, engine: EngineClient) -> AdapterStore:
    """The store `settings` name, its cache never evicting what `engine` serves."""

    def in_use() -> set[str]:
        return {Path(a.path).name for a in engine.list_adapters() if a.path is not None}

    remote = ObjectStore(settings.adapter_store) if settings.adapter_store else None
    return AdapterStore(settings.data_dir, remote=remote,
                        cache_bytes=settings.adapter_cache_bytes, in_use=in_use)


def adapter_fetcher(
    settings: AdapterStoreSettings, engine: EngineClient
) -> Callable[[str], Path] | None:
    """A worker's way to the object store (None without one): a digest's local directory,
    fetched if need be, with the store's failures as the engine's errors."""
    if not settings.adapter_store:
        return None
    store = make_store(settings, engine)

    def fetch(digest: str) -> Path:
        if not _DIGEST.fullmatch(digest):
            raise AdapterError(f"{digest!r} is not an adapter store address")
        try:
            return store.ensure(digest)
        except (BlobMissing, BlobCorrupt) as e:
            raise AdapterError(str(e)) from None
        except StoreUnavailable as e:
            raise EngineUnavailable(str(e)) from None

    return fetch

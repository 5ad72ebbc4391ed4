"""Adapter files on disk, addressed by content: `<data_dir>/adapters/<sha256>/` holds
adapter_config.json and adapter_model.safetensors (see archive.content_digest);
uploads are staged under `<data_dir>/tmp/` and moved in with one rename.

NOTE: replicas may share the data directory, so adding and removing a digest happen
under an advisory file lock; the caller checks, under the same lock, that no version
still uses a digest before removing it.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.registry.archive import ADAPTER_FILES

_DIGEST = re.compile(r"[0-9a-f]{64}")


class AdapterStore:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir / "adapters"
        self.tmp = data_dir / "tmp"
        self._lock_path = self.root / ".lock"

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
        already stored, the staged copy is dropped. Returns the stored directory."""
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

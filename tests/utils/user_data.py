"""Keep the test suite out of the user's data: the environment it runs in, and a guard.

A checkout that ran `make demo` holds a user's data under ./var/ (the demo's database,
its usage rows, its adapter store). The suite runs every server, engine and CLI it starts
on a data dir of its own (`isolate_environment`), and `UserDataGuard` fails any test
after which ./var/ differs from before it, outside the converted-model cache, which is
keyed by content and only read once made.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

# The part of ./var/ that tests may write: the converted bundled model.
MODEL_CACHE = "models"
# Settings that point at a user's data or services; the suite never inherits them.
_USER_SETTINGS = ("DATABASE_URL", "REDIS_URL")
# LORAPLEX_* variables the suite keeps: its own, and the CPU kernels' switch and cache.
_KEPT_PREFIXES = ("LORAPLEX_TEST_", "LORAPLEX_CPU_KERNELS", "LORAPLEX_KERNEL_CACHE")


@dataclass(frozen=True, slots=True)
class Entry:
    kind: str  # "file" | "dir" | "link"
    size: int
    mtime_ns: int
    digest: str = ""  # the content's SHA-256, filled only when asked for


def fingerprint(root: Path, *, exclude: Iterable[str] = (MODEL_CACHE,),
                digests: bool = False) -> dict[str, Entry]:
    """Every entry under root by relative path, less the top-level names in exclude."""
    skipped = set(exclude)
    found: dict[str, Entry] = {}
    if not root.is_dir():
        return found
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if d not in skipped]
            filenames = [f for f in filenames if f not in skipped]
        for name in (*dirnames, *filenames):
            path = here / name
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue  # removed while walking: the next fingerprint tells
            if path.is_symlink():
                kind = "link"
            elif path.is_dir():
                kind = "dir"
            else:
                kind = "file"
            digest = _sha256(path) if digests and kind == "file" else ""
            size = st.st_size if kind == "file" else 0
            found[str(path.relative_to(root))] = Entry(kind, size, st.st_mtime_ns, digest)
    return found


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return "unreadable"
    return h.hexdigest()


def describe_changes(before: dict[str, Entry], after: dict[str, Entry]) -> list[str]:
    changes = [f"created {p}" for p in sorted(after.keys() - before.keys())]
    changes += [f"removed {p}" for p in sorted(before.keys() - after.keys())]
    changes += [f"modified {p}" for p in sorted(before.keys() & after.keys())
                if before[p].kind != "dir" and before[p] != after[p]]
    return changes


class UserDataGuard:
    """A pytest plugin: a test after which `root` changed (outside the model cache) fails
    at teardown, and a session that changed it fails at its end (content compared too)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._session_start: dict[str, Entry] = {}

    def _changes(self, before: dict[str, Entry], *, digests: bool = False) -> list[str]:
        return describe_changes(before, fingerprint(self.root, digests=digests))

    def _message(self, who: str, changes: list[str]) -> str:
        shown = "\n  ".join(changes[:20])
        more = f"\n  ... and {len(changes) - 20} more" if len(changes) > 20 else ""
        return (f"{who} changed the user's data in {self.root} (tests must use a data "
                f"dir of their own; only {self.root / MODEL_CACHE} is shared):\n"
                f"  {shown}{more}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._session_start = fingerprint(self.root, digests=True)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        item.stash[_BEFORE] = fingerprint(self.root)
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, None, None]:
        yield  # the test's fixtures are torn down first: what they wrote counts too
        changes = self._changes(item.stash[_BEFORE])
        if changes:
            pytest.fail(self._message(item.nodeid, changes), pytrace=False)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        changes = self._changes(self._session_start, digests=True)
        if not changes:
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = self._message("the test session", changes)
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(message, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[dict[str, Entry]]()


def isolate_environment(user_data: Path) -> Path:
    """Point this process and every process it starts at a fresh data dir, whose model
    cache is the checkout's, and at float32 engines; forget the user's database, Redis and
    other LORAPLEX_ settings. Returns the new data dir (removed by `remove_isolated`)."""
    for name in list(os.environ):
        if name in _USER_SETTINGS or (
            name.startswith("LORAPLEX_") and not name.startswith(_KEPT_PREFIXES)
        ):
            del os.environ[name]
    models = user_data / MODEL_CACHE
    models.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="loraplex-tests-")) / "var"
    data_dir.mkdir()
    # NOTE: the whole cache directory is linked, not one model in it, so that a model
    # converted by whichever process first needs it lands in the checkout's cache once.
    (data_dir / MODEL_CACHE).symlink_to(models.resolve(), target_is_directory=True)
    os.environ["LORAPLEX_DATA_DIR"] = str(data_dir)
    # NOTE: `--dtype auto` serves bf16 on CPUs with bf16 units; the suite's engines compute
    # in float32 unless a test asks otherwise, since its oracle tests compare exactly with
    # Hugging Face in float32. The bf16 and auto tests name their dtype.
    os.environ["LORAPLEX_DTYPE"] = "float32"
    # NOTE: the suite starts many engines on the bundled model, some alive at once; each
    # backs only the KV blocks it writes (a prefaulted default cache would be 3 GB each at
    # float32). The prefault tests turn it on by name.
    os.environ["LORAPLEX_KV_CACHE_PREFAULT"] = "0"
    return data_dir


def remove_isolated(data_dir: Path) -> None:
    (data_dir / MODEL_CACHE).unlink(missing_ok=True)  # never follow it into the cache
    shutil.rmtree(data_dir.parent, ignore_errors=True)

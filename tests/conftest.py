"""Shared fixtures: the bundled SmolLM2, converted once into <repo>/var/models/ and reused.

The suite runs on a data dir of its own (tests/utils/user_data.py): nothing it starts
reads or writes the checkout's ./var/ (a user's demo data) outside that model cache."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when loraplex_kernels/ is
# first imported, whichever test does it: set it before any test module is collected.
# Without CUDA the Triton kernels then run in the interpreter on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ("pytester",)  # tests/test_user_data_guard.py runs the guard in a pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_DATA_DIR = REPO_ROOT / "var"


def pytest_configure(config: pytest.Config) -> None:
    from tests.utils.user_data import UserDataGuard, isolate_environment

    _pin_worker()

    config.addinivalue_line(
        "markers", "slow: loads the bundled SmolLM2 model (seconds to minutes on 2 CPU cores)"
    )
    config.stash[_ISOLATED] = isolate_environment(CACHE_DATA_DIR)
    config.pluginmanager.register(UserDataGuard(CACHE_DATA_DIR), "loraplex-user-data-guard")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `long` first, the rest in their order: under `make test`'s workers the
    longest one starts at once, not at the end with the other workers waiting for it."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests.utils.user_data import remove_isolated

    if _ISOLATED in config.stash:
        remove_isolated(config.stash[_ISOLATED])


_ISOLATED = pytest.StashKey[Path]()


def _worker_index() -> int | None:
    """This process's index under pytest-xdist (gw0 -> 0, ...), None when run alone."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return int(worker.removeprefix("gw")) if worker else None


def _pin_worker() -> None:
    """Under pytest-xdist (`make test` runs one worker per core): each worker on CPUs of
    its own, torch's team (and the engine's, sized from the affinity; what a test starts
    inherits it) no wider than them.

    NOTE: unpinned, two workers' torch teams of 2 threads each on 2 cores ran the
    CPU-bound tests 3-7x slower (each team waiting at its barriers for a thread the other
    had preempted) and the whole suite gained little; pinned, each test runs as on a
    one-core machine and the two halves of the suite in parallel.
    """
    index = _worker_index()
    if index is None or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    per_worker = max(1, len(cpus) // workers)
    first = (index * per_worker) % len(cpus)
    mine = cpus[first : first + per_worker]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (the GGUF conversion runs only once
    per checkout: about 20 s, then cached under var/models/)."""
    from engine.models.loader import resolve_model_dir

    return resolve_model_dir("default", CACHE_DATA_DIR)


@pytest.fixture(scope="session")
def tiny_model_factory(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """variant name (tests/utils/tiny_models.VARIANTS) -> directory of that random model,
    written once per session."""
    from tests.utils.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    made: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in made:
            made[variant] = make_tiny_model(root / variant, smollm2_dir, variant)
        return made[variant]

    return make


# ------------------------------------------------------------------ databases, Redis


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database at the head revision, once on SQLite and once on PostgreSQL."""
    from tests.utils.databases import migrated_database

    with migrated_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> Iterator[str]:
    """A fresh SQLite database at the head revision (tests that need only one backend)."""
    from tests.utils.databases import migrated_database

    with migrated_database("sqlite", tmp_path) as url:
        yield url


@pytest.fixture
def redis_url() -> Iterator[str]:
    """The real Redis on 127.0.0.1:6379, in a database flushed before and after the test."""
    import redis

    # a database per pytest-xdist worker: 15, 14, ...
    url = os.environ.get(
        "LORAPLEX_TEST_REDIS_URL", f"redis://127.0.0.1:6379/{15 - (_worker_index() or 0)}"
    )
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is not reachable at {url}: {exc}")
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()

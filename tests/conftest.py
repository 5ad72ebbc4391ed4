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

    config.addinivalue_line(
        "markers", "slow: loads the bundled SmolLM2 model (seconds to minutes on 2 CPU cores)"
    )
    config.stash[_ISOLATED] = isolate_environment(CACHE_DATA_DIR)
    config.pluginmanager.register(UserDataGuard(CACHE_DATA_DIR), "loraplex-user-data-guard")


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests.utils.user_data import remove_isolated

    if _ISOLATED in config.stash:
        remove_isolated(config.stash[_ISOLATED])


_ISOLATED = pytest.StashKey[Path]()


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

    url = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
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

"""Real databases for tests: a fresh SQLite file or a fresh PostgreSQL database (on the
server at 127.0.0.1:5432), upgraded to head with the Alembic migrations."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

PG_SERVER_URL = os.environ.get(
    "LORAPLEX_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def postgres_available() -> bool:
    try:
        engine = create_engine(PG_SERVER_URL, connect_args={"connect_timeout": 3})
        with engine.connect():
            pass
        engine.dispose()
        return True
    except Exception:
        return False


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """CREATE DATABASE for one test, DROP it afterwards; yields its URL."""
    name = f"loraplex_test_{secrets.token_hex(6)}"
    admin = create_engine(PG_SERVER_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    base = PG_SERVER_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def empty_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty database of `kind` ("sqlite" or "postgresql")."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'loraplex.db'}"
        return
    if not postgres_available():
        # NOTE: a failure, not a skip: the PostgreSQL half of the suite must not vanish
        # silently on a machine where the server is down.
        pytest.fail(f"PostgreSQL is not reachable at {PG_SERVER_URL}")
    with fresh_postgres_database() as url:
        yield url


@contextmanager
def migrated_database(kind: str, tmp_path: Path) -> Iterator[str]:
    from app.db import upgrade

    with empty_database(kind, tmp_path) as url:
        upgrade(url)
        yield url

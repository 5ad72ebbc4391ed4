"""Real databases for tests: a fresh SQLite file or a fresh PostgreSQL database (on the
server at 127.0.0.1:5432), upgraded to head with the Alembic migrations.

The migrations run once per test session and kind, into a template; each test gets a copy
of it (the SQLite file copied, PostgreSQL's `CREATE DATABASE ... TEMPLATE`), the same
database the migrations would have built for it, in a fraction of the time."""

from __future__ import annotations

import atexit
import functools
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

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


@functools.cache
def _server() -> Engine:
    """The session's connection to the server's maintenance database (CREATE, DROP)."""
    return create_engine(PG_SERVER_URL, isolation_level="AUTOCOMMIT", pool_pre_ping=True)


def _postgres_url(name: str) -> str:
    return f"{PG_SERVER_URL.rsplit('/', 1)[0]}/{name}"


def _create_postgres_database(name: str, template: str | None = None) -> None:
    copy = "" if template is None else f' TEMPLATE "{template}"'
    with _server().connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"{copy}'))


def _drop_postgres_database(name: str) -> None:
    with _server().connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextmanager
def fresh_postgres_database(template: str | None = None) -> Iterator[str]:
    """CREATE DATABASE for one test (a copy of `template` if given), DROP it afterwards;
    yields its URL."""
    name = f"loraplex_test_{secrets.token_hex(6)}"
    _create_postgres_database(name, template)
    try:
        yield _postgres_url(name)
    finally:
        _drop_postgres_database(name)


def _require_postgres() -> None:
    if not postgres_available():
        # NOTE: a failure, not a skip: the PostgreSQL half of the suite must not vanish
        # silently on a machine where the server is down.
        pytest.fail(f"PostgreSQL is not reachable at {PG_SERVER_URL}")


@contextmanager
def empty_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty database of `kind` ("sqlite" or "postgresql")."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'loraplex.db'}"
        return
    _require_postgres()
    with fresh_postgres_database() as url:
        yield url


@functools.cache
def _template(kind: str) -> str:
    """The session's database of `kind` at head, made on first use and removed at exit: a
    SQLite file's path, or a PostgreSQL database's name."""
    from app.db import upgrade

    if kind == "sqlite":
        directory = tempfile.mkdtemp(prefix="loraplex-template-")
        atexit.register(shutil.rmtree, directory, True)
        path = Path(directory) / "template.db"
        upgrade(f"sqlite:///{path}")
        # The migrations' connections are closed, so the WAL is checkpointed into the
        # file: the file alone is the database.
        assert not Path(f"{path}-wal").exists()
        return str(path)
    name = f"loraplex_template_{secrets.token_hex(6)}"
    _create_postgres_database(name)
    atexit.register(_drop_postgres_database, name)
    upgrade(_postgres_url(name))
    return name


@contextmanager
def migrated_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """A fresh database of `kind` at the head revision: a copy of the session's template."""
    if kind == "sqlite":
        target = tmp_path / "loraplex.db"
        shutil.copyfile(_template(kind), target)
        yield f"sqlite:///{target}"
        return
    _require_postgres()
    with fresh_postgres_database(template=_template(kind)) as url:
        yield url

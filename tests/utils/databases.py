"""Real databases for tests: a fresh SQLite file or a fresh PostgreSQL database (on the
server at 127.0.0.1:5432), upgraded to head with the Alembic migrations.

The migrations run once per test session and kind, into a template; each test gets a copy
of it (the SQLite file copied, PostgreSQL's `CREATE DATABASE ... TEMPLATE`), the same
database the migrations would have built for it, in a fraction of the time."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
import threading
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
def fresh_postgres_database(template: str | None = None) -> Iterator[str]:
    """CREATE DATABASE for one test (a copy of `template` if given), DROP it afterwards;
    yields its URL."""
    name = f"loraplex_test_{secrets.token_hex(6)}"
    admin = create_engine(PG_SERVER_URL, isolation_level="AUTOCOMMIT")
    copy = "" if template is None else f' TEMPLATE "{template}"'
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"{copy}'))
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


_templates: dict[str, str] = {}
_templates_lock = threading.Lock()


def _template(kind: str) -> str:
    """The session's template of `kind` at head: a SQLite file path or a PostgreSQL
    database name; made on first use, removed when the session ends."""
    from app.db import upgrade

    with _templates_lock:
        if kind in _templates:
            return _templates[kind]
        if kind == "sqlite":
            directory = tempfile.mkdtemp(prefix="loraplex-template-")
            atexit.register(shutil.rmtree, directory, True)
            path = Path(directory) / "template.db"
            upgrade(f"sqlite:///{path}")
            # The migrations' connections are closed, so the WAL is checkpointed into
            # the file: the file alone is the database.
            assert not Path(f"{path}-wal").exists()
            _templates[kind] = str(path)
        else:
            name = f"loraplex_template_{secrets.token_hex(6)}"
            admin = create_engine(PG_SERVER_URL, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
            atexit.register(_drop_postgres_database, name)
            upgrade(f"{PG_SERVER_URL.rsplit('/', 1)[0]}/{name}")
            admin.dispose()
            _templates[kind] = name
        return _templates[kind]


def _drop_postgres_database(name: str) -> None:
    admin = create_engine(PG_SERVER_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@contextmanager
def migrated_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """A fresh database of `kind` at the head revision: a copy of the session's template."""
    if kind == "sqlite":
        template = _template(kind)
        target = tmp_path / "loraplex.db"
        shutil.copyfile(template, target)
        yield f"sqlite:///{target}"
        return
    if not postgres_available():
        pytest.fail(f"PostgreSQL is not reachable at {PG_SERVER_URL}")
    template = _template(kind)
    with fresh_postgres_database(template=template) as url:
        yield url

"""The Alembic migrations on both databases: from empty to head, down to empty and up
again, and the models never drift from what the migrations build."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from app.db import (
    SchemaOutOfDate,
    current_revision,
    downgrade,
    head_revision,
    make_engine,
    prepare_database,
    upgrade,
)
from app.tables import Base
from tests.utils.databases import empty_database

TABLES = {
    "tenants", "api_keys", "adapters", "adapter_versions", "usage_records", "audit_log",
}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_upgrade_from_empty_downgrade_and_upgrade_again(kind: str, tmp_path: Path) -> None:
    with empty_database(kind, tmp_path) as url:
        engine = make_engine(url)
        try:
            assert current_revision(engine) is None
            upgrade(url)
            assert current_revision(engine) == head_revision()
            assert set(inspect(engine).get_table_names()) >= TABLES
            with engine.connect() as connection:
                diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
            assert diff == [], f"the models and the migrations disagree: {diff}"

            downgrade(url, "base")
            assert current_revision(engine) is None
            assert not TABLES & set(inspect(engine).get_table_names())

            upgrade(url)
            assert current_revision(engine) == head_revision()
            assert set(inspect(engine).get_table_names()) >= TABLES
        finally:
            engine.dispose()


def test_embedded_sqlite_upgrades_itself_postgresql_does_not(tmp_path: Path) -> None:
    with empty_database("sqlite", tmp_path) as url:
        engine = make_engine(url)
        prepare_database(engine)
        assert current_revision(engine) == head_revision()
        engine.dispose()
    with empty_database("postgresql", tmp_path) as url:
        engine = make_engine(url)
        with pytest.raises(SchemaOutOfDate, match="run `loraplex db upgrade`"):
            prepare_database(engine)
        assert current_revision(engine) is None
        upgrade(url)
        prepare_database(engine)  # at head: nothing to say
        engine.dispose()


def test_db_upgrade_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from app import cli

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("DATABASE_URL", url)
    result = CliRunner().invoke(cli.main, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    engine = make_engine(url)
    assert current_revision(engine) == head_revision()
    result = CliRunner().invoke(cli.main, ["db", "downgrade", "base"])
    assert result.exit_code == 0, result.output
    assert current_revision(engine) is None
    engine.dispose()

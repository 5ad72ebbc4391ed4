"""The suite keeps out of the checkout's ./var/ (a user's demo data): it runs on a data
dir of its own, and its guard fails a test that writes there anyway."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.core.config import Settings, WorkerSettings
from engine.config import EngineConfig
from tests.conftest import CACHE_DATA_DIR
from tests.utils.user_data import describe_changes, fingerprint


def test_servers_engines_and_clis_get_a_data_dir_of_their_own() -> None:
    data_dir = Path(os.environ["LORAPLEX_DATA_DIR"])
    user = CACHE_DATA_DIR.resolve()
    assert not data_dir.resolve().is_relative_to(user)
    for configured in (Settings().data_dir, WorkerSettings().data_dir,
                       EngineConfig().resolved_data_dir):
        assert configured.resolve() == data_dir.resolve()
    assert Settings().resolved_database_url == f"sqlite:///{data_dir / 'loraplex.db'}"
    assert "DATABASE_URL" not in os.environ and "REDIS_URL" not in os.environ
    # The one shared part: the converted model, reached through the checkout's cache.
    assert (data_dir / "models").resolve() == (user / "models")


def test_fingerprint_sees_every_change_outside_the_model_cache(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "loraplex.db").write_bytes(b"rows")
    before = fingerprint(tmp_path, digests=True)
    (tmp_path / "models" / "converted").write_text("weights")
    assert describe_changes(before, fingerprint(tmp_path, digests=True)) == []

    stat = (tmp_path / "loraplex.db").stat()
    (tmp_path / "loraplex.db").write_bytes(b"ROWS")  # same size; mtime kept below
    os.utime(tmp_path / "loraplex.db", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "keys.json").write_text("{}")
    assert describe_changes(before, fingerprint(tmp_path, digests=True)) == [
        "created demo", "created demo/keys.json", "modified loraplex.db"]
    # Without digests (the per-test check) a rewrite is seen by its size or mtime.
    (tmp_path / "loraplex.db").write_bytes(b"more rows")
    assert describe_changes(before, fingerprint(tmp_path))[-1] == "modified loraplex.db"


GUARDED_SUITE = '''
from pathlib import Path

import pytest

from tests.utils.user_data import UserDataGuard

ROOT = Path(__file__).parent / "var"


def pytest_configure(config):
    config.pluginmanager.register(UserDataGuard(ROOT), "guard")


@pytest.fixture(scope="session")
def writes_when_the_session_ends():
    yield
    (ROOT / "fixture.txt").write_text("written by a session fixture's teardown")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    if session.config.getoption("keyword") == "late":  # a writer outliving every test
        (ROOT / "late.txt").write_text("written after the last test")
'''


def test_the_guard_fails_a_test_that_writes_into_the_user_data(
    pytester: pytest.Pytester,
) -> None:
    var = pytester.path / "var"
    (var / "models").mkdir(parents=True)
    (var / "demo").mkdir()
    (var / "demo" / "keys.json").write_text('{"acme": "lpx_t_..."}')
    pytester.makeconftest(GUARDED_SUITE)
    pytester.makepyfile(test_writes='''
import sqlite3
from pathlib import Path

ROOT = Path(__file__).parent / "var"


def test_reads_only():
    assert (ROOT / "demo" / "keys.json").read_text()


def test_converts_into_the_model_cache():
    (ROOT / "models" / "SmolLM2").mkdir()
    (ROOT / "models" / "SmolLM2" / "model.safetensors").write_bytes(b"0" * 64)


def test_meters_into_the_demo_database():
    with sqlite3.connect(ROOT / "loraplex.db") as db:
        db.execute("CREATE TABLE usage (request_id TEXT)")
        db.execute("INSERT INTO usage VALUES ('chatcmpl-1')")


def test_rewrites_the_demo_keys():
    (ROOT / "demo" / "keys.json").write_text("{}")
''')
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_meters_into_the_demo_database*",
        "*test_writes.py::test_meters_into_the_demo_database changed the user's data in *",
        "*created loraplex.db*",
        "*ERROR at teardown of test_rewrites_the_demo_keys*",
        "*modified demo/keys.json*",
    ])
    assert "test_converts_into_the_model_cache changed" not in result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_the_guard_fails_a_session_whose_fixtures_write_into_the_user_data(
    pytester: pytest.Pytester,
) -> None:
    (pytester.path / "var").mkdir()
    pytester.makeconftest(GUARDED_SUITE)
    pytester.makepyfile(test_session='''
def test_uses_a_session_fixture(writes_when_the_session_ends):
    pass


def test_late():
    pass
''')
    # A session fixture's teardown runs in the last test's teardown, which it fails.
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-k", "fixture")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_uses_a_session_fixture changed the user's data*",
                                 "*created fixture.txt*"])
    # What is written after the last test fails the session at its end.
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-k", "late")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*the test session changed the user's data in *",
                                 "*created late.txt*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED

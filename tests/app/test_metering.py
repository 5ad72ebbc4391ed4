"""The usage outbox against real SQLite and PostgreSQL: every record arrives exactly once,
through concurrency, duplicates, database outages (a cut TCP connection, a held SQLite
lock), a killed process and a close() while the database is down."""

from __future__ import annotations

import logging
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from app.db import make_engine, session_factory
from app.metering import SpoolBusyError, UsageEvent, UsageRecorder
from app.metering.events import encode_event
from app.tables import UsageRecord, UsageStatus
from tests.utils.databases import migrated_database
from tests.utils.tcp_proxy import TcpProxy

REPO_ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def make_event(i: int, **fields: Any) -> UsageEvent:
    values: dict[str, Any] = {
        "request_id": f"req-{i:06d}",
        "tenant_id": f"ten_{i % 3}",
        "key_id": f"key_{i % 5}",
        "model": "fake-model" if i % 2 else "support-bot",
        "adapter_id": None if i % 2 else "ad_1",
        "adapter_version": None if i % 2 else 1,
        "prompt_tokens": 10 + i % 7,
        "completion_tokens": i % 11,
        "cached_tokens": i % 4,
        "ttft_ms": 5.0 + i,
        "latency_ms": 20.0 + i,
        "status": (UsageStatus.OK, UsageStatus.ABORTED, UsageStatus.ERROR)[i % 3],
        "created_at": T0 + timedelta(seconds=i),
    }
    values.update(fields)
    return UsageEvent(**values)


@dataclass
class Totals:
    rows: int
    distinct: int
    prompt: int
    completion: int
    cached: int


def db_totals(db: sessionmaker[Session]) -> Totals:
    r = UsageRecord
    with db() as session:
        row = session.execute(select(
            func.count(), func.count(func.distinct(r.request_id)),
            func.coalesce(func.sum(r.prompt_tokens), 0),
            func.coalesce(func.sum(r.completion_tokens), 0),
            func.coalesce(func.sum(r.cached_tokens), 0),
        )).one()
    return Totals(*(int(v) for v in row))


def expected_totals(events: list[UsageEvent]) -> Totals:
    unique = {e.request_id: e for e in reversed(events)}.values()
    return Totals(
        rows=len(unique), distinct=len(unique),
        prompt=sum(e.prompt_tokens for e in unique),
        completion=sum(e.completion_tokens for e in unique),
        cached=sum(e.cached_tokens for e in unique),
    )


def segment_files(spool: Path) -> list[Path]:
    return sorted(spool.glob("*.jsonl"))


def spooled_ids(spool: Path) -> list[str]:
    import json

    return [
        json.loads(line)["request_id"]
        for path in segment_files(spool)
        for line in path.read_bytes().splitlines()
    ]


def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def db(database_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(database_url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
def postgresql_url(tmp_path: Path) -> Iterator[str]:
    with migrated_database("postgresql", tmp_path) as url:
        yield url


# ------------------------------------------------------------------ outages, for real


class Outage:
    """A database the recorder reaches through something a test can break."""

    db: sessionmaker[Session]  # what the recorder uses
    observer: sessionmaker[Session]  # a path to the database that stays up

    def cut(self) -> None: ...
    def restore(self) -> None: ...


class SqliteOutage(Outage):
    """Another connection holds the write lock (BEGIN EXCLUSIVE): writers get
    'database is locked' after the busy timeout, readers still read."""

    def __init__(self, url: str) -> None:
        path = make_url(url).database
        assert path is not None
        self.path: str = path
        self.engine = make_engine(url)
        # After make_engine's own pragmas: give up on the lock quickly.
        event.listen(self.engine, "connect", _short_busy_timeout)
        self.db = session_factory(self.engine)
        self.observer_engine = make_engine(url)
        self.observer = session_factory(self.observer_engine)
        self.locker: sqlite3.Connection | None = None

    def cut(self) -> None:
        self.locker = sqlite3.connect(self.path, isolation_level=None)
        self.locker.execute("BEGIN EXCLUSIVE")

    def restore(self) -> None:
        assert self.locker is not None
        self.locker.execute("ROLLBACK")
        self.locker.close()
        self.locker = None

    def close(self) -> None:
        if self.locker is not None:
            self.restore()
        self.engine.dispose()
        self.observer_engine.dispose()


def _short_busy_timeout(dbapi_connection: Any, record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA busy_timeout=50")
    cursor.close()


class PostgresOutage(Outage):
    """The recorder talks to PostgreSQL through a TCP proxy that the test cuts."""

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        self.proxy = TcpProxy(parsed.host or "127.0.0.1", parsed.port or 5432).start()
        proxied = parsed.set(host="127.0.0.1", port=self.proxy.port)
        self.engine = make_engine(proxied.render_as_string(hide_password=False))
        self.db = session_factory(self.engine)
        self.observer_engine = make_engine(url)
        self.observer = session_factory(self.observer_engine)

    def cut(self) -> None:
        self.proxy.cut()

    def stall(self) -> None:
        self.proxy.stall()

    def restore(self) -> None:
        self.proxy.restore()

    def close(self) -> None:
        self.proxy.close()
        self.engine.dispose()
        self.observer_engine.dispose()


@contextmanager
def breakable(database_url: str) -> Iterator[Outage]:
    outage: SqliteOutage | PostgresOutage
    if make_url(database_url).get_backend_name() == "sqlite":
        outage = SqliteOutage(database_url)
    else:
        outage = PostgresOutage(database_url)
    try:
        yield outage
    finally:
        outage.close()


# ------------------------------------------------------------------ delivery


def test_events_from_many_threads_arrive_exactly_once(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    recorder = UsageRecorder(db, spool, batch_size=64, flush_interval_s=0.05)
    recorder.start()
    events = [make_event(i) for i in range(1000)]

    def work(part: list[UsageEvent]) -> None:
        for e in part:
            recorder.record(e)

    threads = [threading.Thread(target=work, args=(events[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert recorder.flush(timeout_s=60) is True
    assert recorder.num_pending == 0
    assert recorder.db_healthy
    assert db_totals(db) == expected_totals(events)
    assert db_totals(db).rows == 1000
    recorder.close()
    assert segment_files(spool) == []


def test_rows_keep_every_field(db: sessionmaker[Session], tmp_path: Path) -> None:
    recorder = UsageRecorder(db, tmp_path / "spool")
    recorder.start()
    sent = make_event(4, ttft_ms=None, created_at=datetime(2026, 3, 1, 23, 59, 59, 999999,
                                                            tzinfo=UTC))
    recorder.record(sent)
    assert recorder.flush(timeout_s=30)
    recorder.close()
    with db() as session:
        row = session.scalars(select(UsageRecord)).one()
    got = UsageEvent(
        request_id=row.request_id, tenant_id=row.tenant_id, key_id=row.key_id,
        model=row.model, adapter_id=row.adapter_id, adapter_version=row.adapter_version,
        prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
        cached_tokens=row.cached_tokens, ttft_ms=row.ttft_ms, latency_ms=row.latency_ms,
        status=UsageStatus(row.status), created_at=row.created_at,
    )
    assert got == sent


def test_duplicates_and_replayed_segments_make_one_row(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    first = make_event(1, completion_tokens=7)
    recorder = UsageRecorder(db, spool, flush_interval_s=0.05)
    recorder.start()
    recorder.record(first)
    recorder.record(first)
    assert recorder.flush(timeout_s=30)
    assert db_totals(db) == Totals(rows=1, distinct=1, prompt=first.prompt_tokens,
                                   completion=7, cached=first.cached_tokens)
    assert recorder.num_pending == 0
    recorder.close()

    # A segment delivered once (a crash between commit and delete) comes back; a second
    # record of the same request with other numbers must not change the first either.
    again = replace(first, completion_tokens=99)
    (spool / "seg-0000000000000007.jsonl").write_bytes(
        encode_event(first) + encode_event(again) + encode_event(make_event(2))
    )
    recorder = UsageRecorder(db, spool, flush_interval_s=0.05)
    recorder.start()
    assert recorder.flush(timeout_s=30)
    assert recorder.num_pending == 0
    recorder.close()
    assert db_totals(db) == expected_totals([first, make_event(2)])
    with db() as session:
        assert session.scalar(
            select(UsageRecord.completion_tokens).where(UsageRecord.request_id == first.request_id)
        ) == 7
    assert segment_files(spool) == []
    assert not (spool / "rejected").exists(), "duplicates are no errors"


def test_record_goes_to_the_os_before_it_returns(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    # A writer that waits an hour: the file is the only place the events are.
    recorder = UsageRecorder(db, spool, batch_size=10_000, flush_interval_s=3600)
    recorder.start()
    recorder.flush(timeout_s=30)  # the writer's first (empty) cycle is over
    events = [make_event(i) for i in range(5)]
    for e in events:
        recorder.record(e)
    assert spooled_ids(spool) == [e.request_id for e in events]
    assert recorder.num_pending == 5
    assert db_totals(db).rows == 0
    assert recorder.flush(timeout_s=30)
    assert db_totals(db) == expected_totals(events)
    recorder.close()


def test_a_second_recorder_on_the_same_spool_is_refused(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    first = UsageRecorder(db, tmp_path / "spool")
    first.start()
    second = UsageRecorder(db, tmp_path / "spool")
    with pytest.raises(SpoolBusyError, match="in use by another recorder"):
        second.start()
    first.close()
    second = UsageRecorder(db, tmp_path / "spool")
    second.start()
    second.close()


def test_record_after_close_is_a_bug(db: sessionmaker[Session], tmp_path: Path) -> None:
    recorder = UsageRecorder(db, tmp_path / "spool")
    with pytest.raises(RuntimeError, match="start"):
        recorder.record(make_event(1))
    recorder.start()
    recorder.close()
    with pytest.raises(RuntimeError, match="after close"):
        recorder.record(make_event(1))


# ------------------------------------------------------------------ outages


def test_outage_records_wait_in_the_spool_and_arrive_once(
    database_url: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    errors: list[BaseException] = []
    with breakable(database_url) as outage:
        recorder = UsageRecorder(outage.db, spool, batch_size=10, flush_interval_s=0.05,
                                 on_db_error=errors.append)
        recorder.start()
        before = [make_event(i) for i in range(5)]
        for e in before:
            recorder.record(e)
        assert recorder.flush(timeout_s=30) is True
        assert errors == []

        outage.cut()
        during = [make_event(i) for i in range(5, 30)]
        for e in during:
            recorder.record(e)
        assert recorder.flush(timeout_s=30) is False
        assert not recorder.db_healthy
        assert errors, "the failed attempts are reported"
        assert recorder.num_pending == 25
        # Durably on disk, each exactly once; nothing of it in the database yet.
        assert sorted(spooled_ids(spool)) == [e.request_id for e in during]
        assert db_totals(outage.observer) == expected_totals(before)

        outage.restore()
        # The writer retries on its own (with backoff): no flush needed.
        wait_until(lambda: recorder.num_pending == 0, timeout_s=30)
        assert recorder.db_healthy
        assert db_totals(outage.observer) == expected_totals(before + during)
        assert segment_files(spool) == []
        recorder.close()


def test_close_while_the_database_is_down_keeps_the_records(
    database_url: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    events = [make_event(i) for i in range(40)]
    with breakable(database_url) as outage:
        recorder = UsageRecorder(outage.db, spool, batch_size=16, flush_interval_s=0.05)
        recorder.start()
        outage.cut()
        for e in events:
            recorder.record(e)
        recorder.close(timeout_s=10)
        assert sorted(spooled_ids(spool)) == [e.request_id for e in events]
        assert db_totals(outage.observer).rows == 0

        recorder = UsageRecorder(outage.db, spool, flush_interval_s=0.05)
        recorder.start()
        assert recorder.flush(timeout_s=30) is False  # still down: still spooled
        assert recorder.num_pending == 40
        outage.restore()
        assert recorder.flush(timeout_s=30) is True
        recorder.close()
        assert db_totals(outage.observer) == expected_totals(events)
        assert segment_files(spool) == []


def test_a_hung_database_never_blocks_record(postgresql_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    with breakable(postgresql_url) as outage:
        assert isinstance(outage, PostgresOutage)
        recorder = UsageRecorder(outage.db, spool, batch_size=5, flush_interval_s=0.05)
        recorder.start()
        recorder.record(make_event(0))
        assert recorder.flush(timeout_s=30)
        outage.stall()  # connections stay open, nothing answers: the writer hangs
        events = [make_event(i) for i in range(1, 51)]
        slowest = 0.0
        for e in events:
            started = time.perf_counter()
            recorder.record(e)
            slowest = max(slowest, time.perf_counter() - started)
        assert slowest < 0.5, f"record() took {slowest * 1000:.1f} ms with the DB hung"
        assert recorder.flush(timeout_s=0.5) is False  # timed out: durably spooled
        assert recorder.num_pending == 50
        assert sorted(spooled_ids(spool)) == [e.request_id for e in events]
        outage.restore()
        wait_until(lambda: recorder.num_pending == 0, timeout_s=60)
        recorder.close()
        assert db_totals(outage.observer) == expected_totals([make_event(0), *events])


def test_rows_the_database_refuses_are_set_aside(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    good = [make_event(i) for i in range(4)]
    bad = encode_event(make_event(9)).replace(b'"model":"fake-model"', b'"model":null')
    assert bad != encode_event(make_event(9))
    (spool / "seg-0000000000000000.jsonl").write_bytes(
        encode_event(good[0]) + encode_event(good[1]) + bad + encode_event(good[2])
    )
    errors: list[BaseException] = []
    recorder = UsageRecorder(db, spool, flush_interval_s=0.05, on_db_error=errors.append)
    recorder.start()
    recorder.record(good[3])
    assert recorder.flush(timeout_s=30) is True
    assert recorder.db_healthy
    assert recorder.num_pending == 0
    recorder.close()
    assert db_totals(db) == expected_totals(good)
    assert (spool / "rejected" / "seg-0000000000000000.jsonl").read_bytes() == bad
    assert len(errors) == 1


# ------------------------------------------------------------------ crashes

CHILD = textwrap.dedent("""
    import sys
    from datetime import timedelta
    from app.db import make_engine, session_factory
    from app.metering import UsageRecorder
    from tests.app.test_metering import make_event

    url, spool, delivered, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    recorder = UsageRecorder(session_factory(make_engine(url)), __import__("pathlib").Path(spool),
                             batch_size=50, flush_interval_s=3600)
    recorder.start()
    for i in range(delivered):
        recorder.record(make_event(i))
    assert recorder.flush(timeout_s=60)
    # Fewer than a batch, with an hour to the next cycle: these stay in the spool file.
    for i in range(delivered, count):
        recorder.record(make_event(i))
    print("recorded", flush=True)
    __import__("time").sleep(600)
""")


def test_a_killed_process_loses_nothing(
    database_url: str, db: sessionmaker[Session], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    spool = tmp_path / "spool"
    # 4 batches' worth delivered before the kill, 30 more only in the spool file.
    delivered, count = 200, 230
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, database_url, str(spool), str(delivered), str(count)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "recorded\n"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert db_totals(db) == expected_totals([make_event(i) for i in range(delivered)])
    leftovers = segment_files(spool)
    assert leftovers, "the undelivered tail is in the spool"
    # A write torn by the crash: half a line at the end of the last segment.
    with open(leftovers[-1], "ab") as f:
        f.write(b'{"v":1,"request_id":"req-torn","tenant_')

    caplog.set_level(logging.WARNING, logger="app.metering.spool")
    recorder = UsageRecorder(db, spool, flush_interval_s=0.05)
    recorder.start()
    assert recorder.flush(timeout_s=60) is True
    recorder.close()
    assert db_totals(db) == expected_totals([make_event(i) for i in range(count)])
    assert segment_files(spool) == []
    assert "skipped 1 unreadable line" in caplog.text
    assert (spool / "rejected" / leftovers[-1].name).read_bytes() == (
        b'{"v":1,"request_id":"req-torn","tenant_\n'
    )


def test_a_growing_spool_is_logged_loudly(
    database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = tmp_path / "spool"
    with breakable(database_url) as outage:
        recorder = UsageRecorder(outage.db, spool, batch_size=4, flush_interval_s=0.05,
                                 spool_warn_bytes=1000)
        recorder.start()
        outage.cut()
        caplog.set_level(logging.ERROR, logger="app.metering.recorder")
        for i in range(20):
            recorder.record(make_event(i))
        assert recorder.flush(timeout_s=30) is False
        assert recorder.spool_bytes == sum(p.stat().st_size for p in segment_files(spool))
        assert recorder.spool_bytes > 1000
        assert "waiting for the database" in caplog.text
        outage.restore()
        assert recorder.flush(timeout_s=30) is True
        assert recorder.spool_bytes == 0
        recorder.close()

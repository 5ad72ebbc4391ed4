"""UsageRecorder: the batched, durable outbox between requests and usage_records.

`record()` (any thread, the event loop included) writes the event to the spool and
returns; one writer thread moves spool segments into the database, each in one
transaction with `INSERT ... ON CONFLICT (request_id) DO NOTHING`, and deletes a segment
only after its commit. Delivery is at least once (a crash between commit and delete
replays the segment) and the unique request id makes it exactly one row.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app.db import session_scope
from app.metering.events import UsageEvent, event_row
from app.metering.spool import Segment, Spool
from app.tables import UsageRecord

__all__ = ["UsageEvent", "UsageRecorder"]

logger = logging.getLogger(__name__)

_TABLE = cast(Table, UsageRecord.__table__)
# Rows per INSERT statement: far below the bound-parameter limits of both databases.
_ROWS_PER_STATEMENT = 1000
_RETRY_FIRST_S = 0.2
_RETRY_MAX_S = 5.0
_SPOOL_WARN_EVERY_S = 60.0


class UsageRecorder:
    """Records one UsageEvent per request; never blocks the caller on the database."""

    def __init__(
        self,
        db: sessionmaker[Session],
        spool_dir: Path,
        *,
        batch_size: int = 500,
        flush_interval_s: float = 0.25,
        on_db_error: Callable[[BaseException], None] | None = None,
        spool_warn_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        assert batch_size >= 1 and flush_interval_s > 0
        self._db = db
        self._spool = Spool(spool_dir)
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._on_db_error = on_db_error
        self._spool_warn_bytes = spool_warn_bytes
        # Guards the fields below that record(), flush() and the writer share.
        self._cond = threading.Condition()
        self._stopping = False
        self._flush_requested = 0  # generation of the latest flush() call
        self._flush_done = 0  # generation the writer has finished
        self._flush_ok = True  # whether that finished flush reached the database
        self._thread: threading.Thread | None = None
        self._closed = False
        # Writer-thread state (also touched by start() before the thread runs).
        self._backlog: deque[Segment] = deque()  # sealed segments waiting for the database
        self._healthy = True
        self._retry_delay_s = _RETRY_FIRST_S
        self._next_retry = 0.0
        self._last_cycle = 0.0
        self._last_spool_warning = -_SPOOL_WARN_EVERY_S

    # ------------------------------------------------------------------ public surface

    def start(self) -> None:
        """Take the spool directory, queue what an earlier process left there for
        delivery, and start the writer thread."""
        assert self._thread is None and not self._closed, "start() once"
        leftovers = self._spool.open()
        if leftovers:
            logger.info(
                "usage spool: replaying %d record(s) from %d segment(s) left in %s",
                sum(s.num_records for s in leftovers), len(leftovers), self._spool.directory,
            )
        self._backlog.extend(leftovers)
        self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
        self._thread.start()

    def record(self, event: UsageEvent) -> None:
        """Spool one event (written to the OS before this returns) for the writer.
        Thread-safe; a few microseconds; never touches the database."""
        if self._closed:
            raise RuntimeError("UsageRecorder.record() after close()")
        if self._spool.append(event) == self._batch_size:
            with self._cond:
                self._cond.notify()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Deliver everything recorded so far now. True once it is all in the database;
        False when the database is down (or the timeout passes): then it is durably in
        the spool instead."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._spool.sync_current()
            return self._spool.num_records == 0
        with self._cond:
            self._flush_requested += 1
            generation = self._flush_requested
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: self._flush_done >= generation, timeout_s)
            ok = done and self._flush_ok
        if not done:
            self._spool.sync_current()
        return ok

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what the database takes within `timeout_s`, leave the rest durably in
        the spool (the next start() delivers it) and stop the writer."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None:
            with self._cond:
                # The writer runs one last forced cycle, then exits.
                self._stopping = True
                self._cond.notify_all()
            thread.join(timeout_s)
            if thread.is_alive():
                logger.error(
                    "usage writer still busy after %.1f s; %d record(s) stay in the spool %s",
                    timeout_s, self.num_pending, self._spool.directory,
                )
        self._spool.close()
        if self.num_pending:
            logger.warning(
                "usage recorder closed with %d record(s) in the spool %s; the next start "
                "delivers them", self.num_pending, self._spool.directory,
            )

    @property
    def num_pending(self) -> int:
        """Recorded (or left by an earlier process) but not yet in the database."""
        return self._spool.num_records

    @property
    def db_healthy(self) -> bool:
        """False from a failed write until the next successful one."""
        return self._healthy

    @property
    def spool_bytes(self) -> int:
        return self._spool.nbytes

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due():
                    self._cond.wait(self._wait_s())
                generation = self._flush_requested
                stopping = self._stopping
            forced = stopping or generation > self._flush_done
            try:
                ok = self._cycle(forced)
            except Exception:
                # NOTE: a bug must not kill the only writer; the spool keeps the records.
                logger.exception("usage writer cycle failed")
                self._failed()
                ok = False
            self._last_cycle = time.monotonic()
            with self._cond:
                if generation > self._flush_done:
                    self._flush_done = generation
                    self._flush_ok = ok
                    self._cond.notify_all()
            if stopping:
                return

    def _due(self) -> bool:
        if self._stopping or self._flush_requested > self._flush_done:
            return True
        if self._spool.current_count >= self._batch_size:
            return True
        return self._wait_s() <= 0

    def _wait_s(self) -> float:
        due = self._last_cycle + self._flush_interval_s if self._healthy else self._next_retry
        return due - time.monotonic()

    def _cycle(self, forced: bool) -> bool:
        """Deliver the backlog, then the current segment; True if all are in the database.
        While the database is down (and between retries), only seal full segments."""
        if not self._healthy and not forced and time.monotonic() < self._next_retry:
            self._spill_current(forced=False)
            self._warn_if_spool_large()
            return False
        while self._backlog:
            if not self._deliver(self._backlog[0]):
                self._spill_current(forced)
                self._warn_if_spool_large()
                return False
            self._backlog.popleft()
        seg = self._spool.seal()
        if seg is not None and not self._deliver(seg):
            self._to_backlog(seg)
            self._warn_if_spool_large()
            return False
        if not self._healthy:
            logger.warning("usage database is back; the spool is delivered")
        self._healthy = True
        self._retry_delay_s = _RETRY_FIRST_S
        return True

    def _spill_current(self, forced: bool) -> None:
        """While the database is down, the current segment grows up to a batch; then (or
        when a flush asks for durability) it is sealed and fsynced."""
        if forced or self._spool.current_count >= self._batch_size:
            seg = self._spool.seal()
            if seg is not None:
                self._to_backlog(seg)

    def _to_backlog(self, seg: Segment) -> None:
        self._spool.persist(seg)
        self._backlog.append(seg)

    def _deliver(self, seg: Segment) -> bool:
        """Insert one segment in one transaction and delete it; False if the database
        could not take it (the segment stays, for a retry)."""
        events = self._spool.read(seg)
        try:
            self._insert(events)
        except (DataError, IntegrityError) as exc:
            if exc.connection_invalidated:
                self._failed(exc)
                return False
            # NOTE: a row the database refuses (not an outage) must not hold up every
            # record behind it: insert one by one and set the refused ones aside.
            self._report(exc)
            try:
                refused = self._insert_one_by_one(events)
            except Exception as exc2:
                self._failed(exc2)
                return False
            logger.error(
                "usage database refused %d record(s) of %s (%s); kept in %s",
                len(refused), seg.path.name, exc.orig, self._spool.directory / "rejected",
            )
            self._spool.reject(seg, refused)
        except Exception as exc:
            self._failed(exc)
            return False
        self._spool.remove(seg)
        return True

    def _insert(self, events: list[UsageEvent]) -> None:
        unique: dict[str, dict[str, Any]] = {}
        for event in events:
            unique.setdefault(event.request_id, event_row(event))
        rows = list(unique.values())
        if not rows:
            return
        with session_scope(self._db) as session:
            statement = _upsert(session.get_bind().dialect.name)
            for i in range(0, len(rows), _ROWS_PER_STATEMENT):
                session.execute(statement, rows[i:i + _ROWS_PER_STATEMENT])

    def _insert_one_by_one(self, events: list[UsageEvent]) -> list[UsageEvent]:
        refused: list[UsageEvent] = []
        for event in events:
            try:
                self._insert([event])
            except (DataError, IntegrityError) as exc:
                if exc.connection_invalidated:
                    raise
                refused.append(event)
        return refused

    def _failed(self, exc: BaseException | None = None) -> None:
        if exc is not None:
            self._report(exc)
            if self._healthy:
                logger.warning(
                    "usage database unavailable (%s: %s); records wait in the spool %s",
                    type(exc).__name__, exc, self._spool.directory,
                )
        self._healthy = False
        self._next_retry = time.monotonic() + self._retry_delay_s
        self._retry_delay_s = min(self._retry_delay_s * 2, _RETRY_MAX_S)

    def _report(self, exc: BaseException) -> None:
        if self._on_db_error is None:
            return
        try:
            self._on_db_error(exc)
        except Exception:
            logger.exception("on_db_error callback failed")

    def _warn_if_spool_large(self) -> None:
        # NOTE: records are never dropped to save disk (they are bills); a spool that
        # keeps growing is an outage someone must see, so say so loudly and often.
        now = time.monotonic()
        nbytes = self._spool.nbytes
        if nbytes >= self._spool_warn_bytes and now - self._last_spool_warning >= (
            _SPOOL_WARN_EVERY_S
        ):
            self._last_spool_warning = now
            logger.error(
                "usage spool %s holds %.1f MiB (%d records) waiting for the database",
                self._spool.directory, nbytes / 2**20, self._spool.num_records,
            )


def _upsert(dialect: str) -> Any:
    """INSERT ... ON CONFLICT (request_id) DO NOTHING, in the database's own dialect."""
    if dialect == "postgresql":
        return postgresql.insert(_TABLE).on_conflict_do_nothing(index_elements=["request_id"])
    assert dialect == "sqlite", f"usage records support PostgreSQL and SQLite, not {dialect}"
    return sqlite.insert(_TABLE).on_conflict_do_nothing(index_elements=["request_id"])

"""The durable local spool of usage events: append-only segment files of JSON lines.

Every event is written to the operating system (one `write` call) before `record()`
returns, so a killed process loses nothing; a segment is fsynced when it has to wait
on disk (the database is down) and when the spool closes. Segments are delivered and
deleted in order; whatever is left when the process ends is replayed by the next one.

    <dir>/.lock                     held (flock) by the one process using the spool
    <dir>/seg-<seq>.jsonl           segments, oldest first
    <dir>/rejected/seg-<seq>.jsonl  lines the database refused or nobody could parse
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from app.metering.events import UsageEvent, decode_event, encode_event

logger = logging.getLogger(__name__)

_PREFIX = "seg-"
_SUFFIX = ".jsonl"


class SpoolBusyError(RuntimeError):
    """Another recorder (in this or another process) holds the spool directory."""


@dataclass(slots=True)
class Segment:
    """One segment file and what is known of it without reading it."""

    path: Path
    num_records: int = 0
    nbytes: int = 0
    # The events in memory; None once they are only on disk (read() parses the file).
    events: list[UsageEvent] | None = field(default_factory=list)
    # False after a failed write: the file lacks records that `events` still has.
    complete_on_disk: bool = True
    # Unreadable lines already set aside (a segment is re-read on every retry).
    checked: bool = False
    fd: int | None = None


def _seq_of(path: Path) -> int:
    return int(path.name[len(_PREFIX):-len(_SUFFIX)])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class Spool:
    """Segment files under one directory, used by one recorder at a time (thread-safe)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._lock_fd: int | None = None
        self._current: Segment | None = None
        self._next_seq = 0
        self._num_records = 0
        self._nbytes = 0
        self._is_open = False

    # ---------------------------------------------------------------- lifecycle

    def open(self) -> list[Segment]:
        """Take the directory (SpoolBusyError if another recorder has it) and return the
        segments an earlier process left, oldest first."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            # NOTE: two recorders on one directory would replay (and delete) each other's
            # live segments: refuse instead. Each process needs a spool of its own.
            raise SpoolBusyError(
                f"the usage spool {self.directory} is in use by another recorder; give "
                "each server process its own spool directory"
            ) from None
        self._lock_fd = fd
        leftovers: list[Segment] = []
        for path in sorted(self.directory.glob(f"{_PREFIX}*{_SUFFIX}"), key=_seq_of):
            data = path.read_bytes()
            if not data:
                path.unlink()
                continue
            # A torn last line has no newline: it is not counted, and read() drops it.
            leftovers.append(
                Segment(path, num_records=data.count(b"\n"), nbytes=len(data), events=None)
            )
        with self._lock:
            self._next_seq = _seq_of(leftovers[-1].path) + 1 if leftovers else 0
            for seg in leftovers:
                self._num_records += seg.num_records
                self._nbytes += seg.nbytes
            self._is_open = True
        return leftovers

    def close(self) -> None:
        """Make the current segment durable and let go of the directory."""
        with self._lock:
            if not self._is_open:
                return
            self._is_open = False
            current, self._current = self._current, None
        if current is not None and current.fd is not None:
            os.fsync(current.fd)
            os.close(current.fd)
            current.fd = None
        _fsync_dir(self.directory)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # ---------------------------------------------------------------- hot path

    def append(self, event: UsageEvent) -> int:
        """Write one event (to the OS, not fsynced) into the current segment; returns how
        many records that segment holds now."""
        line = encode_event(event)
        with self._lock:
            if not self._is_open:
                raise RuntimeError("the usage spool is not open (start() the recorder first)")
            seg = self._current
            if seg is None:
                seg = self._current = self._new_segment()
            if seg.complete_on_disk and seg.fd is not None:
                try:
                    _write_all(seg.fd, line)
                except OSError as exc:
                    # NOTE: the event is still delivered from memory; only a crash before
                    # then would lose it. Stop writing to this file: a partial line must
                    # stay the last one.
                    seg.complete_on_disk = False
                    logger.error("usage spool write failed (%s): %s", seg.path, exc)
            assert seg.events is not None, "the current segment keeps its events"
            seg.events.append(event)
            seg.num_records += 1
            seg.nbytes += len(line)
            self._num_records += 1
            self._nbytes += len(line)
            return seg.num_records

    def _new_segment(self) -> Segment:
        path = self.directory / f"{_PREFIX}{self._next_seq:016d}{_SUFFIX}"
        self._next_seq += 1
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o600)
        except OSError as exc:
            logger.error("cannot create usage spool segment %s: %s", path, exc)
            return Segment(path, complete_on_disk=False)
        return Segment(path, fd=fd)

    # ---------------------------------------------------------------- writer side

    @property
    def num_records(self) -> int:
        """Records in the spool: recorded (or left by an earlier process), not delivered."""
        return self._num_records

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def current_count(self) -> int:
        current = self._current
        return 0 if current is None else current.num_records

    def seal(self) -> Segment | None:
        """End the current segment (new events go to a new one); None if it is empty."""
        with self._lock:
            seg = self._current
            if seg is None or seg.num_records == 0:
                return None
            self._current = None
        if seg.fd is not None:
            os.close(seg.fd)
            seg.fd = None
        return seg

    def sync_current(self) -> None:
        """fsync the current segment (a flush that could not reach the database)."""
        with self._lock:
            seg = self._current
            fd = None if seg is None or seg.fd is None else os.dup(seg.fd)
        if fd is not None:
            # A duplicate descriptor: fsync without holding up record().
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def persist(self, seg: Segment) -> None:
        """Make a sealed segment durable before it waits on disk, and drop its events
        from memory so that a long outage costs disk, not memory."""
        if not seg.complete_on_disk:
            assert seg.events is not None, "an incomplete segment keeps its events"
            try:
                tmp = seg.path.with_suffix(".tmp")
                tmp.write_bytes(b"".join(encode_event(e) for e in seg.events))
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                tmp.replace(seg.path)
                seg.complete_on_disk = True
            except OSError as exc:
                logger.error(
                    "usage spool: %d records of %s are only in memory (%s)",
                    seg.num_records, seg.path, exc,
                )
                return
        try:
            fd = os.open(seg.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(self.directory)
        except OSError as exc:
            logger.error("usage spool: cannot fsync %s: %s", seg.path, exc)
        seg.events = None

    def read(self, seg: Segment) -> list[UsageEvent]:
        """The segment's events; lines that do not parse (a torn last line after a crash)
        are set aside in rejected/ with a warning."""
        if seg.events is not None:
            return seg.events
        try:
            data = seg.path.read_bytes()
        except FileNotFoundError:
            logger.error("usage spool segment %s disappeared", seg.path)
            return []
        events: list[UsageEvent] = []
        bad: list[bytes] = []
        for line in data.splitlines(keepends=True):
            try:
                events.append(decode_event(line))
            except ValueError:
                bad.append(line if line.endswith(b"\n") else line + b"\n")
        if bad and not seg.checked:
            logger.warning(
                "usage spool %s: skipped %d unreadable line(s) (a torn write?); kept in %s",
                seg.path.name, len(bad), self.directory / "rejected",
            )
            self._write_rejected(seg, b"".join(bad))
        seg.checked = True
        return events

    def remove(self, seg: Segment) -> None:
        """The segment is in the database: forget it."""
        seg.path.unlink(missing_ok=True)
        with self._lock:
            self._num_records -= seg.num_records
            self._nbytes -= seg.nbytes

    def reject(self, seg: Segment, events: list[UsageEvent]) -> None:
        """Set aside events the database refused (bad data, not an outage)."""
        self._write_rejected(seg, b"".join(encode_event(e) for e in events))

    def _write_rejected(self, seg: Segment, data: bytes) -> None:
        rejected = self.directory / "rejected"
        rejected.mkdir(exist_ok=True)
        with open(rejected / seg.path.name, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    """Make file creations and renames in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

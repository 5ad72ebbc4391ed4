"""AdapterRegistry on SQLite and PostgreSQL: versions, content-addressed files, engine
validation and registration, deletes, quotas, and the engine sync of every replica."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.api.errors import service_error
from app.audit import AuditContext
from app.core.config import Settings
from app.core.errors import ServiceError
from app.core.principal import AdapterRef
from app.db import make_engine, session_factory, session_scope
from app.registry.archive import CONFIG_FILE, WEIGHTS_FILE
from app.registry.service import AdapterRegistry
from app.tables import Adapter, AdapterStatus, AdapterVersion, AuditLog, Tenant, utcnow
from engine.client import AdapterInfo, EngineUnavailable
from engine.lora.weights import AdapterError
from tests.app.test_archive import Entry, write_tar_gz, write_zip
from tests.utils.fake_engine import FakeEngine

ADMIN = AuditContext(actor="key_admin", request_id="req-1")
_seed = count(1)


class CheckingEngine(FakeEngine):
    """A FakeEngine whose add_adapter reads the directory as the real engine does: both
    files must be there; a config with use_dora (or "refuse") is refused, naming the
    file by its full path as the real engine's reasons do."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_calls: list[tuple[str, Path]] = []

    async def add_adapter(self, name: str, path: str) -> AdapterInfo:
        directory = Path(path)
        self.add_calls.append((name, directory))
        config_path = directory / CONFIG_FILE
        if not config_path.is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise AdapterError(f"{directory} has no {CONFIG_FILE}")
        config = json.loads(config_path.read_text())
        if config.get("use_dora"):
            raise AdapterError(f"{config_path}: use_dora=True asks for DoRA, not supported")
        if "refuse" in config:
            raise AdapterError(f"{directory / WEIGHTS_FILE}: {config['refuse']}")
        return await super().add_adapter(name, path)


def archive_bytes(config: dict[str, Any] | None = None, weights: bytes | None = None
                  ) -> list[Entry]:
    """The members of a distinct adapter (each call differs unless given the same)."""
    config = {"peft_type": "LORA", "r": 8, "seed": next(_seed)} if config is None else config
    weights = b"weights-%d" % next(_seed) if weights is None else weights
    return [Entry(CONFIG_FILE, json.dumps(config).encode()), Entry(WEIGHTS_FILE, weights)]


def make_archive(tmp_path: Path, entries: list[Entry], kind: str = "zip") -> Path:
    path = tmp_path / f"upload-{next(_seed)}"
    if kind == "zip":
        return write_zip(path.with_suffix(".zip"), entries)
    return write_tar_gz(path.with_suffix(".tar.gz"), entries)


@dataclass
class Env:
    registry: AdapterRegistry
    engine: CheckingEngine
    db: sessionmaker[Session]
    data_dir: Path
    tmp_path: Path

    def archive(self, entries: list[Entry] | None = None, kind: str = "zip") -> Path:
        return make_archive(self.tmp_path, archive_bytes() if entries is None else entries, kind)

    async def upload(self, name: str, archive: Path | None = None, *,
                     tenant_id: str | None = None, enforce_quota: bool = False) -> Any:
        return await self.registry.upload(
            archive or self.archive(), name=name, tenant_id=tenant_id, by=ADMIN,
            enforce_quota=enforce_quota,
        )

    def count(self, model: type[Any]) -> int:
        with session_scope(self.db) as s:
            return int(s.scalar(select(func.count()).select_from(model)) or 0)

    def versions(self) -> list[AdapterVersion]:
        with session_scope(self.db) as s:
            return list(s.scalars(select(AdapterVersion).order_by(AdapterVersion.created_at)))

    def audit_actions(self) -> list[tuple[str, str]]:
        with session_scope(self.db) as s:
            return [(a.action, a.actor) for a in s.scalars(select(AuditLog).order_by(AuditLog.id))]

    def add_tenant(self, tenant_id: str, **fields: Any) -> None:
        with session_scope(self.db) as s:
            s.add(Tenant(id=tenant_id, name=tenant_id, **fields))

    def tmp_entries(self) -> list[str]:
        return sorted(p.name for p in (self.data_dir / "tmp").iterdir())


@pytest.fixture
def db(database_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(database_url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
async def env(db: sessionmaker[Session], tmp_path: Path) -> AsyncIterator[Env]:
    engine = CheckingEngine()
    data_dir = tmp_path / "data"
    registry = AdapterRegistry(db, engine, Settings(data_dir=data_dir), file_grace_s=0)
    await registry.start()
    yield Env(registry, engine, db, data_dir, tmp_path)
    await registry.stop()


# ---------------------------------------------------------------------------- uploads


async def test_upload_stores_records_and_registers_a_ready_version(env: Env) -> None:
    archive = env.archive(archive_bytes(weights=b"w" * 100))
    view = await env.upload("support-bot", archive)
    assert (view.name, view.version, view.status, view.tenant_id) == (
        "support-bot", 1, AdapterStatus.READY, None)
    stored = env.data_dir / "adapters" / view.sha256
    assert env.engine.add_calls == [(f"av/{view.id}", stored)]
    info = env.engine.get_adapter(f"av/{view.id}")
    assert info is not None and info.path == str(stored)
    assert sorted(p.name for p in stored.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert (stored / WEIGHTS_FILE).read_bytes() == b"w" * 100
    assert (stored / WEIGHTS_FILE).stat().st_mode & 0o777 == 0o444
    config_bytes = (stored / CONFIG_FILE).stat().st_size
    assert view.report == {
        "rank": 8, "alpha": 16.0, "use_rslora": False, "target_modules": ["q_proj", "v_proj"],
        "size_bytes": config_bytes + 100, "config_bytes": config_bytes, "weights_bytes": 100,
        "memory_bytes": 1024,
    }
    assert view.size_bytes == config_bytes + 100
    assert archive.exists(), "the caller owns the archive"
    assert env.tmp_entries() == []
    [row] = env.versions()
    assert (row.id, row.status, row.rank, row.sha256, row.created_by) == (
        view.id, "ready", 8, view.sha256, "key_admin")
    with session_scope(env.db) as s:
        adapter = s.get(Adapter, view.adapter_id)
        assert adapter is not None and (adapter.owner, adapter.tenant_id) == ("shared", None)
        [log] = s.scalars(select(AuditLog)).all()
        assert (log.action, log.actor, log.target_id, log.request_id) == (
            "adapter.upload", "key_admin", view.adapter_id, "req-1")
        assert log.details["version"] == 1 and log.details["sha256"] == view.sha256


async def test_versions_increment_and_same_content_shares_one_directory(env: Env) -> None:
    first, second = archive_bytes(), archive_bytes()
    v1 = await env.upload("bot", env.archive(first))
    v2 = await env.upload("bot", env.archive(second, kind="tar.gz"))
    v3 = await env.upload("bot", env.archive(first, kind="tar.gz"))
    other = await env.upload("other", env.archive(first))
    assert [v.version for v in (v1, v2, v3, other)] == [1, 2, 3, 1]
    assert v1.adapter_id == v2.adapter_id == v3.adapter_id != other.adapter_id
    assert v1.sha256 == v3.sha256 == other.sha256 != v2.sha256
    assert env.registry.store.digests() == sorted({v1.sha256, v2.sha256})
    # Every version is served under its own name, old ones included (name@1 still works).
    assert sorted(a.name for a in env.engine.list_adapters()) == sorted(
        f"av/{v.id}" for v in (v1, v2, v3, other))
    [bot, oth] = env.registry.list_adapters()
    assert ([v.version for v in bot.versions], bot.latest_ready) == ([1, 2, 3], 3)
    assert oth.name == "other"


async def test_concurrent_uploads_of_one_name_get_distinct_versions(env: Env) -> None:
    archives = [env.archive() for _ in range(4)]
    views = await asyncio.gather(*(env.upload("busy", a) for a in archives))
    assert sorted(v.version for v in views) == [1, 2, 3, 4]
    assert env.count(Adapter) == 1


async def test_engine_refusal_keeps_a_failed_version_and_nothing_else(env: Env) -> None:
    archive = env.archive(archive_bytes(config={"peft_type": "LORA", "use_dora": True}))
    with pytest.raises(ServiceError) as info:
        await env.upload("dora", archive)
    error = service_error(info.value)
    assert (error.status_code, error.code, error.param) == (422, "invalid_adapter", "file")
    # The reason as the engine gave it, without the server's directories.
    assert error.message == "adapter_config.json: use_dora=True asks for DoRA, not supported"
    assert str(env.data_dir) not in error.message
    [row] = env.versions()
    assert (row.status, row.report) == ("failed", {"error": error.message})
    assert env.engine.list_adapters() == []
    assert env.registry.store.digests() == []
    assert env.tmp_entries() == []


async def test_a_failed_upload_does_not_remove_files_a_ready_version_uses(env: Env) -> None:
    good = archive_bytes()
    ready = await env.upload("good", env.archive(good))
    env.engine.adapters.clear()  # as if this content failed this time (e.g. another engine)
    refusing = CheckingEngine()

    async def refuse(name: str, path: str) -> AdapterInfo:
        raise AdapterError("refused here")

    refusing.add_adapter = refuse  # type: ignore[method-assign]
    env.registry.engine = refusing
    with pytest.raises(ServiceError):
        await env.upload("again", env.archive(good))
    assert env.registry.store.digests() == [ready.sha256]


async def test_an_upload_no_engine_can_validate_now_is_withdrawn(env: Env) -> None:
    kept = await env.upload("kept", env.archive())
    gone = await env.upload("gone", env.archive())
    await env.registry.delete(gone.adapter_id, owner=None, by=ADMIN)
    real_add = env.engine.add_adapter

    async def unavailable(name: str, path: str) -> AdapterInfo:
        env.engine.add_calls.append((name, Path(path)))
        raise EngineUnavailable("no worker is in rotation")

    env.engine.add_adapter = unavailable  # type: ignore[method-assign]
    for name in ("new", "kept", "gone"):
        with pytest.raises(ServiceError) as info:
            await env.upload(name)
        error = service_error(info.value)
        assert (error.status_code, error.code) == (503, "overloaded")
        assert error.headers == {"Retry-After": "2"}
    # A new name leaves no row; an existing one keeps its versions as they were; a
    # deleted one stays deleted; no files but those of the ready version.
    assert [(a.name, [v.version for v in a.versions], a.deleted_at is None)
            for a in env.registry.list_adapters(include_deleted=True)] == [
        ("kept", [1], True), ("gone", [1], False),
    ]
    assert env.registry.store.digests() == [kept.sha256]
    assert env.tmp_entries() == []
    assert [a for a, _ in env.audit_actions()][-6:] == [
        "adapter.upload", "adapter.upload_withdrawn"] * 3
    env.engine.add_adapter = real_add  # type: ignore[method-assign]
    again = await env.upload("new")
    assert (again.version, again.status) == (1, AdapterStatus.READY)


async def test_archive_refusals_write_no_rows_and_leave_no_files(env: Env) -> None:
    bad = env.archive([Entry(CONFIG_FILE, b"{}"), Entry("adapter_model.bin", b"\x80\x04.")])
    with pytest.raises(ServiceError) as info:
        await env.upload("pickled", bad)
    assert (service_error(info.value).status_code, info.value.code) == (400, "invalid_archive")
    assert "pickle" in info.value.message
    assert (env.count(Adapter), env.count(AdapterVersion), env.count(AuditLog)) == (0, 0, 0)
    assert env.engine.add_calls == []
    assert env.tmp_entries() == []


@pytest.mark.parametrize("name", ["a/b", "a@1", "", "-lead", "x" * 65, "sp ace", "fake-model"])
async def test_invalid_names_are_refused_before_anything(env: Env, name: str) -> None:
    with pytest.raises(ServiceError) as info:
        await env.upload(name)
    assert (service_error(info.value).status_code, info.value.code, info.value.param) == (
        400, "invalid_adapter_name", "name")
    assert env.count(AdapterVersion) == 0


async def test_unknown_or_deleted_tenants_are_404(env: Env) -> None:
    env.add_tenant("ten_gone", deleted_at=utcnow())
    for tenant_id in ("ten_nope", "ten_gone"):
        with pytest.raises(ServiceError) as info:
            await env.upload("x", tenant_id=tenant_id)
        assert (service_error(info.value).status_code, info.value.param) == (404, "tenant_id")
    assert env.count(Adapter) == 0


async def test_max_adapters_counts_live_names(env: Env) -> None:
    env.add_tenant("ten_a", max_adapters=2)
    a = await env.upload("a", tenant_id="ten_a", enforce_quota=True)
    await env.upload("a", tenant_id="ten_a", enforce_quota=True)  # a new version is free
    with pytest.raises(ServiceError):  # a refused upload does not count
        await env.upload("broken", env.archive(archive_bytes(config={"refuse": "no"})),
                         tenant_id="ten_a", enforce_quota=True)
    await env.upload("b", tenant_id="ten_a", enforce_quota=True)
    with pytest.raises(ServiceError) as info:
        await env.upload("c", tenant_id="ten_a", enforce_quota=True)
    error = service_error(info.value)
    assert (error.status_code, error.code) == (403, "max_adapters_exceeded")
    assert "limit (max_adapters) is 2" in info.value.message
    # Admins are not held to it; deleting one frees a place.
    await env.upload("c", tenant_id="ten_a", enforce_quota=False)
    await env.registry.delete(a.adapter_id, owner="ten_a", by=ADMIN)
    await env.registry.delete(
        env.registry.list_adapters(owner="ten_a")[-1].id, owner=None, by=ADMIN)
    d = await env.upload("d", tenant_id="ten_a", enforce_quota=True)
    assert d.status == AdapterStatus.READY
    assert sorted(v.name for v in env.registry.list_adapters(owner="ten_a")) == [
        "b", "broken", "d"]


# ---------------------------------------------------------------------------- deletes


async def test_delete_removes_versions_from_engine_and_unshared_files(env: Env) -> None:
    shared_content = archive_bytes()
    v1 = await env.upload("bot", env.archive(shared_content))
    v2 = await env.upload("bot")
    keep = await env.upload("keeper", env.archive(shared_content))
    view = await env.registry.delete(v1.adapter_id, owner=None, by=ADMIN)
    assert view.deleted_at is not None
    assert [v.status for v in view.versions] == [AdapterStatus.DELETED] * 2
    assert [a.name for a in env.engine.list_adapters()] == [f"av/{keep.id}"]
    # v2's files are gone; v1's content is still used by `keeper`.
    assert env.registry.store.digests() == [keep.sha256]
    assert v2.sha256 not in env.registry.store.digests()
    assert env.audit_actions()[-1] == ("adapter.delete", "key_admin")
    assert [a.name for a in env.registry.list_adapters()] == ["keeper"]
    assert [a.name for a in env.registry.list_adapters(include_deleted=True)] == [
        "bot", "keeper"]
    # A deleted adapter is gone for its owner, still readable by an admin.
    assert env.registry.get_adapter(v1.adapter_id).deleted_at is not None
    with pytest.raises(ServiceError) as info:
        env.registry.get_adapter(v1.adapter_id, owner="shared")
    assert service_error(info.value).status_code == 404
    with pytest.raises(ServiceError):
        await env.registry.delete(v1.adapter_id, owner=None, by=ADMIN)
    # The name comes back with the next number: bot@1 never names other content.
    again = await env.upload("bot")
    assert (again.adapter_id, again.version) == (v1.adapter_id, 3)


async def test_deleting_while_validating_leaves_nothing_served(env: Env) -> None:
    entered, gate = asyncio.Event(), asyncio.Event()

    async def slow_add(name: str, path: str) -> AdapterInfo:
        entered.set()
        await gate.wait()
        return await FakeEngine.add_adapter(env.engine, name, path)

    env.engine.add_adapter = slow_add  # type: ignore[method-assign]
    upload = asyncio.create_task(env.upload("racy"))
    await entered.wait()
    [adapter] = env.registry.list_adapters()
    assert [v.status for v in adapter.versions] == [AdapterStatus.VALIDATING]
    await env.registry.delete(adapter.id, owner=None, by=ADMIN)
    gate.set()
    with pytest.raises(ServiceError) as info:
        await upload
    assert (service_error(info.value).status_code, info.value.code) == (409, "conflict")
    assert env.engine.list_adapters() == []
    assert [v.status for v in env.versions()] == ["deleted"]


async def test_a_tenant_cannot_delete_or_see_another_owners_adapter(env: Env) -> None:
    env.add_tenant("ten_a")
    env.add_tenant("ten_b")
    mine = await env.upload("mine", tenant_id="ten_a")
    shared = await env.upload("shared-one")
    for adapter_id in (mine.adapter_id, shared.adapter_id):
        with pytest.raises(ServiceError) as info:
            await env.registry.delete(adapter_id, owner="ten_b", by=ADMIN)
        assert service_error(info.value).status_code == 404
        assert info.value.message == f"No adapter with id '{adapter_id}'."
    assert len(env.engine.list_adapters()) == 2
    assert [a.name for a in env.registry.list_adapters(owner="ten_a")] == ["mine"]
    assert env.registry.list_adapters(owner="ten_b") == []


async def test_deleted_files_stay_for_the_grace_period(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    engine = CheckingEngine()
    registry = AdapterRegistry(db, engine, Settings(data_dir=tmp_path / "d"), file_grace_s=3600)
    await registry.start()
    try:
        view = await registry.upload(make_archive(tmp_path, archive_bytes()), name="x",
                                     tenant_id=None, by=ADMIN)
        await registry.delete(view.adapter_id, owner=None, by=ADMIN)
        assert engine.list_adapters() == []
        # Requests still running on it may need to read it again.
        assert registry.store.has(view.sha256)
        assert registry.collect_orphans() == []
    finally:
        await registry.stop()
    # With no grace, an unused directory is an orphan.
    bare = AdapterRegistry(db, engine, Settings(data_dir=tmp_path / "d"), file_grace_s=0)
    assert bare.collect_orphans() == [view.sha256]
    assert bare.store.digests() == []


# ---------------------------------------------------------------------------- engine sync


def ref_of(view: Any) -> AdapterRef:
    return AdapterRef(adapter_id=view.adapter_id, version_id=view.id, tenant_id=view.tenant_id,
                      name=view.name, version=view.version, sha256=view.sha256, created=0)


def in_thread(fn: Any) -> Any:
    """Run fn in another thread (as the directory's refresh does) and return its result."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


async def test_a_replica_registers_and_removes_what_the_directory_reports(env: Env) -> None:
    v1 = await env.upload("one")
    v2 = await env.upload("two")
    # A second replica: same database and store, its own engine.
    replica_engine = CheckingEngine()
    replica = AdapterRegistry(env.db, replica_engine, Settings(data_dir=env.data_dir),
                              file_grace_s=0)
    # Reported before start (the directory's first load): queued, run at start.
    early = in_thread(lambda: replica.on_versions_changed([ref_of(v1), ref_of(v2)], []))
    assert not early.done()
    await replica.start()
    try:
        result = await asyncio.wrap_future(early)
        assert sorted(result.added) == sorted([f"av/{v1.id}", f"av/{v2.id}"])
        assert replica_engine.add_calls == [
            (f"av/{v.id}", env.data_dir / "adapters" / v.sha256) for v in (v1, v2)]
        # Idempotent: what the engine has is skipped.
        future = in_thread(lambda: replica.on_versions_changed([ref_of(v1)], []))
        again = await asyncio.wrap_future(future)
        assert (again.added, again.removed, again.failed) == ((), (), {})
        future = in_thread(lambda: replica.on_versions_changed([], [ref_of(v1)]))
        removed = await asyncio.wrap_future(future)
        assert removed.removed == (f"av/{v1.id}",)
        assert [a.name for a in replica_engine.list_adapters()] == [f"av/{v2.id}"]
    finally:
        await replica.stop()


async def test_a_version_a_replica_cannot_load_is_retried(env: Env) -> None:
    view = await env.upload("flaky")
    stored = env.registry.store.path(view.sha256)
    hidden = stored.with_name("hidden")
    stored.rename(hidden)  # e.g. a shared store not yet visible on this node
    replica_engine = CheckingEngine()
    replica = AdapterRegistry(env.db, replica_engine, Settings(data_dir=env.data_dir))
    await replica.start()
    try:
        name = f"av/{view.id}"
        first = await replica.engine_sync.sync([ref_of(view)], [])
        assert list(first.failed) == [name] and first.added == ()
        assert list(replica.engine_sync.failed) == [name]
        hidden.rename(stored)
        second = await replica.engine_sync.sync([], [])
        assert (second.added, second.failed) == ((name,), {})
        assert replica.engine_sync.failed == {}
    finally:
        await replica.stop()

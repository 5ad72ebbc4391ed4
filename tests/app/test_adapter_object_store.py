"""Adapter files in an S3-compatible object store, against a real one (moto's standalone
server over HTTP, behind a TCP proxy a test can cut): the store's round trip and hash
check, each node's bounded cache, replicas that share a database and the store but no
directory, and the store's faults (an upload answers 503 and leaves nothing; a corrupted
blob is never served)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select

from app.core.config import Settings
from app.db import make_engine, session_factory, session_scope
from app.main import create_app
from app.registry.archive import CONFIG_FILE, WEIGHTS_FILE, content_digest
from app.registry.object_store import BlobCorrupt, BlobMissing, ObjectStore, StoreUnavailable
from app.registry.store import AdapterStore
from app.tables import Adapter, AdapterVersion, UsageRecord
from tests.app.test_registry import CheckingEngine
from tests.utils.s3_server import aws_environment, moto_server, s3_client
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer, tar_gz
from tests.utils.tcp_proxy import TcpProxy

ADMIN = bearer(ADMIN_KEY)
_serial = count()


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with moto_server(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture
def proxy(moto: str) -> Iterator[TcpProxy]:
    with TcpProxy("127.0.0.1", int(moto.rsplit(":", 1)[1])) as proxy, \
            aws_environment(f"http://127.0.0.1:{proxy.port}"):
        yield proxy


@pytest.fixture
def store_url(moto: str, proxy: TcpProxy) -> str:
    bucket = f"adapters-{next(_serial)}-{int(time.time() * 1000) % 10**9}"
    s3_client(moto).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/loraplex/adapters"


def write_adapter(directory: Path, seed: int, weights_bytes: int = 64) -> str:
    """A PEFT-shaped directory; its content address."""
    directory.mkdir(parents=True, exist_ok=True)
    config = json.dumps({"peft_type": "LORA", "r": 8, "seed": seed}).encode()
    weights = hashlib.sha256(b"%d" % seed).digest() * (weights_bytes // 32 + 1)
    (directory / CONFIG_FILE).write_bytes(config)
    (directory / WEIGHTS_FILE).write_bytes(weights[:weights_bytes])
    return content_digest(hashlib.sha256(config).hexdigest(),
                          hashlib.sha256(weights[:weights_bytes]).hexdigest())


def corrupt(moto: str, store_url: str, digest: str) -> None:
    bucket, _, prefix = store_url.removeprefix("s3://").partition("/")
    s3_client(moto).put_object(Bucket=bucket, Key=f"{prefix}/{digest}/{WEIGHTS_FILE}",
                               Body=b"not the weights that were uploaded")


# ------------------------------------------------------------------------- the store


def test_files_go_up_and_come_back_hash_checked(
    moto: str, store_url: str, tmp_path: Path
) -> None:
    remote = ObjectStore(store_url)
    digest = write_adapter(tmp_path / "a", seed=1, weights_bytes=20 * 1024 * 1024)
    remote.upload(digest, tmp_path / "a")
    assert remote.has(digest) and not remote.has("0" * 64)
    assert set(remote.digests()) == {digest}
    (tmp_path / "back").mkdir()
    remote.download(digest, tmp_path / "back")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()

    corrupt(moto, store_url, digest)
    (tmp_path / "bad").mkdir()
    with pytest.raises(BlobCorrupt, match="do not hash to their address"):
        remote.download(digest, tmp_path / "bad")
    assert list((tmp_path / "bad").iterdir()) == []
    (tmp_path / "none").mkdir()
    with pytest.raises(BlobMissing):
        remote.download("1" * 64, tmp_path / "none")
    assert list((tmp_path / "none").iterdir()) == []


def test_an_unreachable_store_is_reported_not_waited_on(
    store_url: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    remote = ObjectStore(store_url)
    digest = write_adapter(tmp_path / "a", seed=2)
    proxy.cut()
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="unreachable"):
        remote.upload(digest, tmp_path / "a")
    with pytest.raises(StoreUnavailable):
        remote.has(digest)
    assert time.monotonic() - start < 30
    proxy.restore()
    remote.upload(digest, tmp_path / "a")
    assert remote.has(digest)


def test_each_node_caches_what_it_fetched_under_its_bound(
    store_url: str, tmp_path: Path
) -> None:
    remote = ObjectStore(store_url)
    digests = [write_adapter(tmp_path / f"src{i}", seed=10 + i, weights_bytes=1000)
               for i in range(4)]
    for i, digest in enumerate(digests):
        remote.upload(digest, tmp_path / f"src{i}")
    in_use = {digests[0]}
    # Room for two adapters of ~1 KB each.
    cache = AdapterStore(tmp_path / "node", remote=remote, cache_bytes=2200,
                         in_use=lambda: in_use)
    for digest in digests[:3]:
        path = cache.ensure(digest)
        assert (path / WEIGHTS_FILE).stat().st_size == 1000
        time.sleep(0.01)  # distinct use times
    # The third pushed out the least recently used one not in use: the second.
    assert set(cache.digests()) == {digests[0], digests[2]}
    cache.ensure(digests[2])  # a hit: used again, nothing fetched or evicted
    assert set(cache.digests()) == {digests[0], digests[2]}
    cache.ensure(digests[3])
    assert set(cache.digests()) == {digests[0], digests[3]}
    in_use.clear()
    cache.ensure(digests[1])  # fetched again; now the first may go too
    assert set(cache.digests()) == {digests[3], digests[1]}
    assert not any(cache.tmp.iterdir())


# ------------------------------------------------------------------------- replicas


@dataclass
class Replica:
    app: FastAPI
    client: httpx.AsyncClient
    engine: CheckingEngine
    data_dir: Path


@asynccontextmanager
async def replica(database_url: str, data_dir: Path, store_url: str, *,
                  max_adapter_bytes: int = 1024 * 1024) -> AsyncIterator[Replica]:
    engine = CheckingEngine(max_adapter_bytes=max_adapter_bytes)
    app = create_app(engine, Settings(
        data_dir=data_dir, database_url=database_url, admin_key=ADMIN_KEY,
        secret_key=SECRET_KEY, adapter_store=store_url, refresh_interval_s=0.2,
    ))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://testserver"
    ) as client:
        yield Replica(app, client, engine, data_dir)


def _count(database_url: str, table: type[Any]) -> int:
    engine = make_engine(database_url)
    try:
        with session_scope(session_factory(engine)) as s:
            return int(s.scalar(select(func.count()).select_from(table)) or 0)
    finally:
        engine.dispose()


async def _upload(r: Replica, directory: Path, name: str) -> httpx.Response:
    return await r.client.post(
        "/admin/adapters", headers=ADMIN, data={"name": name},
        files={"file": ("a.tar.gz", tar_gz(directory), "application/gzip")},
    )


async def _until(check: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _served(r: Replica) -> dict[str, Path]:
    return {name: path for name, path in r.engine.add_calls}


async def test_replicas_sharing_no_directory_serve_an_upload_from_the_store(
    database_url: str, store_url: str, tmp_path: Path
) -> None:
    digest = write_adapter(tmp_path / "adapter", seed=3)
    async with replica(database_url, tmp_path / "a", store_url) as a, \
            replica(database_url, tmp_path / "b", store_url) as b:
        r = await _upload(a, tmp_path / "adapter", "support-bot")
        assert r.status_code == 201, r.text
        assert r.json()["sha256"] == digest
        assert digest in ObjectStore(store_url).digests()
        await _until(lambda: any(p.name == digest for p in _served(b).values()))
        [path] = [p for p in _served(b).values() if p.name == digest]
        # B fetched the files into its own directory; nothing of A's is shared.
        assert path.is_relative_to(tmp_path / "b")
        assert (path / WEIGHTS_FILE).read_bytes() == (
            tmp_path / "adapter" / WEIGHTS_FILE).read_bytes()
        models = (await b.client.get("/v1/models", headers=ADMIN)).json()["data"]
        assert "support-bot" in {m["id"] for m in models}


async def test_an_upload_while_the_store_is_down_is_503_and_leaves_nothing(
    database_url: str, store_url: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    write_adapter(tmp_path / "adapter", seed=4)
    async with replica(database_url, tmp_path / "a", store_url) as a:
        proxy.cut()
        r = await _upload(a, tmp_path / "adapter", "support-bot")
        assert r.status_code == 503, r.text
        assert "adapter store" in r.json()["error"]["message"]
        assert "retry-after" in r.headers
        assert (_count(database_url, Adapter), _count(database_url, AdapterVersion)) == (0, 0)
        store = AdapterStore(tmp_path / "a")
        assert store.digests() == [] and list(store.tmp.iterdir()) == []
        assert a.engine.list_adapters() == []
        proxy.restore()
        assert ObjectStore(store_url).digests() == {}
        r = await _upload(a, tmp_path / "adapter", "support-bot")
        assert r.status_code == 201, r.text


async def test_a_corrupted_blob_is_never_served(
    moto: str, database_url: str, store_url: str, tmp_path: Path
) -> None:
    digest = write_adapter(tmp_path / "adapter", seed=5)
    async with replica(database_url, tmp_path / "a", store_url) as a:
        r = await _upload(a, tmp_path / "adapter", "support-bot")
        assert r.status_code == 201, r.text
    corrupt(moto, store_url, digest)
    async with replica(database_url, tmp_path / "b", store_url) as b:
        registry = b.app.state.loraplex.registry
        await _until(lambda: registry.engine_sync.failed)
        [ref] = registry.engine_sync.failed.values()
        assert ref.sha256 == digest
        assert _served(b) == {}
        assert AdapterStore(tmp_path / "b").digests() == []
        # A request for it fails alone, saying why; the base model serves on.
        r = await _chat(b, "support-bot")
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "adapter_unavailable"
        assert "do not hash to their address" in error["message"]
        assert (await _chat(b, b.engine.model_id)).status_code == 200


async def _chat(r: Replica, model: str) -> httpx.Response:
    return await r.client.post("/v1/chat/completions", headers=ADMIN, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


async def test_with_the_store_down_cached_adapters_serve_and_others_fail_alone(
    database_url: str, store_url: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    write_adapter(tmp_path / "adapter", seed=6)
    async with replica(database_url, tmp_path / "a", store_url) as a:
        r = await _upload(a, tmp_path / "adapter", "support-bot")
        assert r.status_code == 201, r.text
        proxy.cut()
        # A has the files from the upload: it serves on.
        assert (await _chat(a, "support-bot")).status_code == 200
        async with replica(database_url, tmp_path / "b", store_url) as b:
            registry = b.app.state.loraplex.registry
            await _until(lambda: registry.engine_sync.failed)
            r = await _chat(b, "support-bot")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "adapter_unavailable"
            assert "unreachable" in r.json()["error"]["message"]
            assert (await b.client.get("/ready")).status_code == 200
            assert (await _chat(b, b.engine.model_id)).status_code == 200
            # The store is back: the refused request set off another try.
            proxy.restore()
            assert (await _chat(b, "support-bot")).status_code == 503
            await _until(lambda: not registry.engine_sync.failed)
            assert (await _chat(b, "support-bot")).status_code == 200


# ------------------------------------------------------------------------- imports


def _put(moto: str, bucket: str, objects: dict[str, bytes]) -> None:
    client = s3_client(moto)
    for key, body in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)


def _adapter_objects(prefix: str, seed: int) -> dict[str, bytes]:
    config = json.dumps({"peft_type": "LORA", "r": 8, "seed": seed}).encode()
    return {f"{prefix}{CONFIG_FILE}": config, f"{prefix}{WEIGHTS_FILE}": b"weights-%d" % seed}


# case -> (objects under "in/", status, message fragment)
HOSTILE_IMPORTS: dict[str, tuple[dict[str, bytes], int, str]] = {
    "traversal": ({**_adapter_objects("in/", 20), "in/x/../../evil.txt": b"x"}, 400,
                  "not a plain path"),
    "nested": (_adapter_objects("in/a/b/", 21), 400, "nested"),
    "pickle": ({**_adapter_objects("in/", 22), "in/adapter_model.bin": b"\x80\x04."}, 400,
               "pickle"),
    "unknown-file": ({**_adapter_objects("in/", 23), "in/run.sh": b"rm -rf /"}, 400,
                     "Unexpected archive member"),
    "too-many": ({**_adapter_objects("in/", 24),
                  **{f"in/notes-{i}.md": b"." for i in range(70)}}, 400, "more than 64 objects"),
    "too-large": ({**_adapter_objects("in/", 25), f"in/{WEIGHTS_FILE}": b"\0" * 3 * 1024**2},
                  413, "decompression bomb"),
    "empty": ({"elsewhere/x": b"x"}, 400, "nothing under"),
    "no-weights": ({f"in/{CONFIG_FILE}": b"{}"}, 400, f"has no {WEIGHTS_FILE}"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_IMPORTS))
async def test_hostile_imports_are_refused_and_leave_nothing(
    moto: str, sqlite_url: str, store_url: str, tmp_path: Path, case: str
) -> None:
    bucket = store_url.removeprefix("s3://").split("/")[0]
    objects, status, message = HOSTILE_IMPORTS[case]
    _put(moto, bucket, objects)
    async with replica(sqlite_url, tmp_path / "a", store_url) as a:
        r = await a.client.post("/admin/adapters/import", headers=ADMIN, json={
            "name": "imported", "source": f"s3://{bucket}/in/"})
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == "source"
        assert message in r.json()["error"]["message"]
        assert (_count(sqlite_url, Adapter), _count(sqlite_url, AdapterVersion)) == (0, 0)
        store = AdapterStore(tmp_path / "a")
        assert store.digests() == [] and list(store.tmp.iterdir()) == []
        assert ObjectStore(store_url).digests() == {}


@pytest.mark.parametrize("source", ["s3://Not_A_Bucket/x", "https://example.com/x",
                                    "s3://bucket/../x", ""])
async def test_imports_from_what_is_not_an_s3_prefix_are_400(
    sqlite_url: str, store_url: str, tmp_path: Path, source: str
) -> None:
    async with replica(sqlite_url, tmp_path / "a", store_url) as a:
        r = await a.client.post("/admin/adapters/import", headers=ADMIN,
                                json={"name": "imported", "source": source})
        assert r.status_code == 400, r.text
        assert _count(sqlite_url, Adapter) == 0


async def test_an_import_while_the_store_is_down_is_503_and_leaves_nothing(
    moto: str, database_url: str, store_url: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    bucket = store_url.removeprefix("s3://").split("/")[0]
    _put(moto, bucket, _adapter_objects("in/", 26))
    async with replica(database_url, tmp_path / "a", store_url) as a:
        proxy.cut()
        r = await a.client.post("/admin/adapters/import", headers=ADMIN, json={
            "name": "imported", "source": f"s3://{bucket}/in/"})
        assert r.status_code == 503, r.text
        assert "right now" in r.json()["error"]["message"]
        assert _count(database_url, AdapterVersion) == 0
        assert list(AdapterStore(tmp_path / "a").tmp.iterdir()) == []
        proxy.restore()


def test_import_and_gc_from_the_command_line(
    moto: str, database_url: str, store_url: str, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from app.cli import main
    from tests.utils.live_server import serve_in_thread

    bucket = store_url.removeprefix("s3://").split("/")[0]
    _put(moto, bucket, _adapter_objects("training/run-7/", 27))
    engine = CheckingEngine(max_adapter_bytes=1024 * 1024)
    app = create_app(engine, Settings(
        data_dir=tmp_path / "a", database_url=database_url, admin_key=ADMIN_KEY,
        secret_key=SECRET_KEY, adapter_store=store_url, request_timeout_s=0.5,
    ))

    def cli(*args: str) -> Any:
        return CliRunner().invoke(main, ["admin", "--url", url, "--admin-key", ADMIN_KEY,
                                         *args], env={"COLUMNS": "100"})

    with serve_in_thread(app) as url:
        result = cli("adapters", "import", "run-7", f"s3://{bucket}/training/run-7/")
        assert result.exit_code == 0, result.output
        assert "status" in result.output and "ready" in result.output
        [digest] = ObjectStore(store_url).digests()
        listed = httpx.get(f"{url}/admin/adapters", headers=ADMIN).json()["data"]
        assert [(a["name"], a["versions"][0]["sha256"]) for a in listed] == [("run-7", digest)]
        # In use: gc keeps it. Deleted, and past the grace period: gc removes it.
        result = cli("adapters", "gc", "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.output) == {"removed": []}
        httpx.delete(f"{url}/admin/adapters/{listed[0]['id']}", headers=ADMIN).raise_for_status()
        time.sleep(1.5)
        result = cli("adapters", "gc", "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.output) == {"removed": [digest]}
        assert ObjectStore(store_url).digests() == {}
        assert AdapterStore(tmp_path / "a").digests() == []


async def test_a_store_cut_during_an_upload_leaves_nothing(
    sqlite_url: str, store_url: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    import threading

    digest = write_adapter(tmp_path / "adapter", seed=7, weights_bytes=24 * 1024 * 1024)
    engine = CheckingEngine(max_adapter_bytes=64 * 1024 * 1024)
    app = create_app(engine, Settings(
        data_dir=tmp_path / "a", database_url=sqlite_url, admin_key=ADMIN_KEY,
        secret_key=SECRET_KEY, adapter_store=store_url,
    ))
    before = proxy.accepted

    def cut_once_the_upload_connects() -> None:
        deadline = time.monotonic() + 60
        while proxy.accepted == before and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(0.05)  # some of the weights on their way
        proxy.cut()

    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://testserver"
    ) as client:
        cutter = threading.Thread(target=cut_once_the_upload_connects)
        cutter.start()
        r = await _upload(Replica(app, client, engine, tmp_path / "a"), tmp_path / "adapter",
                          "big-bot")
        cutter.join()
        assert r.status_code == 503, r.text
        assert "adapter store" in r.json()["error"]["message"]
        assert (_count(sqlite_url, Adapter), _count(sqlite_url, AdapterVersion)) == (0, 0)
        store = AdapterStore(tmp_path / "a")
        assert store.digests() == [] and list(store.tmp.iterdir()) == []
        assert engine.list_adapters() == []
    proxy.restore()
    # Nothing servable: at most the weights, cut short or whole, which orphan collection
    # removes (no version uses them).
    assert not ObjectStore(store_url).has(digest)


async def test_a_store_cut_while_a_replica_fetches_fails_that_adapter_alone(
    database_url: str, store_url: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    import threading

    weights = 16 * 1024 * 1024
    digest = write_adapter(tmp_path / "adapter", seed=8, weights_bytes=weights)
    limit = 64 * 1024 * 1024
    async with replica(database_url, tmp_path / "a", store_url, max_adapter_bytes=limit) as a:
        r = await _upload(a, tmp_path / "adapter", "big-bot")
        assert r.status_code == 201, r.text
        r = await a.client.post("/admin/tenants", headers=ADMIN, json={
            "name": f"fetch-{next(_serial)}", "tier": "standard", "isolation": "shared"})
        assert r.status_code == 201, r.text
        r = await a.client.post(f"/admin/tenants/{r.json()['id']}/keys", headers=ADMIN,
                                json={"name": "t"})
        assert r.status_code == 201, r.text
        tenant = bearer(r.json()["key"])
    # A slow link, so that the second replica's fetch is surely under way when it is cut.
    proxy.throttle(4 * 1024 * 1024)
    fetched: list[int] = []

    def cut_once_a_megabyte_arrived() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            partial = list((tmp_path / "b").glob(f"**/fetch-*/{WEIGHTS_FILE}"))
            sizes = [p.stat().st_size for p in partial if p.exists()]
            if sizes and max(sizes) >= 1024 * 1024:
                fetched.append(max(sizes))
                proxy.cut()
                return
            time.sleep(0.005)

    async def chat(b: Replica, model: str) -> httpx.Response:
        return await b.client.post("/v1/chat/completions", headers=tenant, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

    served: list[str] = []  # the ids of the responses answered 200
    cutter = threading.Thread(target=cut_once_a_megabyte_arrived)
    cutter.start()
    async with replica(database_url, tmp_path / "b", store_url, max_adapter_bytes=limit) as b:
        registry = b.app.state.loraplex.registry
        await _until(lambda: registry.engine_sync.failed, timeout_s=60)
        cutter.join()
        assert fetched and fetched[0] < weights, "the fetch was not cut half way"
        # Nothing half-fetched is kept or served.
        store = AdapterStore(tmp_path / "b")
        assert store.digests() == [] and list(store.tmp.iterdir()) == []
        assert _served(b) == {}
        # That adapter fails alone, saying why; the replica stays ready; the base serves.
        r = await chat(b, "big-bot")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "adapter_unavailable"
        assert "the object store is unreachable" in r.json()["error"]["message"]
        assert (await b.client.get("/ready")).status_code == 200
        for _ in range(3):
            r = await chat(b, b.engine.model_id)
            assert r.status_code == 200, r.text
            served.append(r.json()["id"])
        # The store is back: the next try fetches it whole.
        proxy.throttle(None)
        proxy.restore()
        await chat(b, "big-bot")  # sets off the retry (503 while it runs)
        await _until(lambda: not registry.engine_sync.failed, timeout_s=30)
        r = await chat(b, "big-bot")
        assert r.status_code == 200, r.text
        served.append(r.json()["id"])
        assert AdapterStore(tmp_path / "b").digests() == [digest]
    # No usage row lost: every answered request has its row (flushed at shutdown).
    engine = make_engine(database_url)
    try:
        with session_scope(session_factory(engine)) as s:
            rows = {row.request_id: row for row in s.scalars(
                select(UsageRecord).where(UsageRecord.request_id.in_(served)))}
    finally:
        engine.dispose()
    assert sorted(rows) == sorted(served)
    assert all(row.status == "ok" and row.completion_tokens > 0 for row in rows.values())

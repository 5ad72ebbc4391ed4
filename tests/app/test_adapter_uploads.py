"""Adapter uploads over HTTP through the whole app (real keys, real database on SQLite
and PostgreSQL): hostile archives refused with a reason and no trace, streamed size
limits, scopes and ownership, and validation by a real engine on a tiny model."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import tarfile
import tempfile
import zipfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from app.api.middleware import RequestContextMiddleware
from app.core.config import Settings
from app.db import make_engine, session_factory, session_scope
from app.main import create_app
from app.metrics import Metrics
from app.registry.archive import CONFIG_FILE, WEIGHTS_FILE
from app.tables import Adapter, AdapterVersion, AuditLog
from engine.async_engine import AsyncEngine
from engine.client import EngineClient, RequestRejected
from engine.config import EngineConfig
from engine.request import EngineRequest, SamplingParams
from tests.app.test_archive import Entry, write_tar_gz, write_zip
from tests.app.test_registry import CheckingEngine, archive_bytes
from tests.utils.fake_engine import FakeEngine
from tests.utils.peft_adapters import copy_adapter, make_peft_adapter, truncate_weights
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer

MiB = 1024 * 1024
ADMIN = bearer(ADMIN_KEY)


@dataclass
class Server:
    app: FastAPI
    client: httpx.AsyncClient
    engine: EngineClient
    data_dir: Path
    database_url: str
    keys: dict[str, str] = field(default_factory=dict)  # role -> key
    tenants: dict[str, str] = field(default_factory=dict)  # "a" / "b" -> tenant id

    def auth(self, role: str) -> dict[str, str]:
        return ADMIN if role == "admin" else bearer(self.keys[role])

    async def upload(self, data: bytes, name: str = "bot", *, role: str = "admin",
                     path: str = "/admin/adapters", **fields: str) -> httpx.Response:
        return await self.client.post(
            path, files={"file": ("adapter.bin", data, "application/octet-stream")},
            data={"name": name, **fields}, headers=self.auth(role),
        )

    def count(self, model: type[Any]) -> int:
        engine = make_engine(self.database_url)
        try:
            with session_scope(session_factory(engine)) as s:
                return int(s.scalar(select(func.count()).select_from(model)) or 0)
        finally:
            engine.dispose()

    def audit(self) -> list[tuple[str, str, str | None]]:
        engine = make_engine(self.database_url)
        try:
            with session_scope(session_factory(engine)) as s:
                rows = s.scalars(select(AuditLog).where(AuditLog.action.like("adapter.%"))
                                 .order_by(AuditLog.id))
                return [(r.action, r.actor, r.request_id) for r in rows]
        finally:
            engine.dispose()

    def stored(self) -> list[str]:
        root = self.data_dir / "adapters"
        return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))

    def temp_entries(self) -> list[str]:
        return sorted(p.name for p in (self.data_dir / "tmp").iterdir())


@asynccontextmanager
async def running(engine: EngineClient, database_url: str, data_dir: Path,
                  **settings: Any) -> AsyncIterator[Server]:
    """The real app (lifespan started) with tenants a (max_adapters 2) and b and keys."""
    app = create_app(engine, Settings(
        data_dir=data_dir, database_url=database_url, admin_key=ADMIN_KEY,
        secret_key=SECRET_KEY, **settings,
    ))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=transport, base_url="http://testserver"
    ) as client:
        server = Server(app, client, engine, data_dir, database_url)
        for tenant, quota in (("a", 2), ("b", None)):
            r = await client.post("/admin/tenants", headers=ADMIN, json={
                "name": f"tenant-{tenant}", "tier": "standard", "isolation": "shared",
                "quotas": {"max_adapters": quota},
            })
            assert r.status_code == 201, r.text
            server.tenants[tenant] = r.json()["id"]
        for role, tenant, scopes in (("a-writer", "a", ["inference", "adapters:write"]),
                                     ("a-reader", "a", ["inference"]),
                                     ("b-writer", "b", ["inference", "adapters:write"])):
            r = await client.post(f"/admin/tenants/{server.tenants[tenant]}/keys",
                                  headers=ADMIN, json={"name": role, "scopes": scopes})
            assert r.status_code == 201, r.text
            server.keys[role] = r.json()["key"]
        yield server


@pytest.fixture
async def server(database_url: str, tmp_path: Path) -> AsyncIterator[Server]:
    # A 1 MiB engine bound: archives may unpack to 2 MiB (with docs), upload ~2.1 MiB.
    engine = CheckingEngine(max_adapter_bytes=MiB)
    async with running(engine, database_url, tmp_path / "data") as s:
        yield s


def zipped(entries: list[Entry]) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return write_zip(Path(d) / "a.zip", entries).read_bytes()


def tarred(entries: list[Entry]) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return write_tar_gz(Path(d) / "a.tar.gz", entries).read_bytes()


# ---------------------------------------------------------------------------- hostile


def tree(root: Path, skip: Callable[[Path], bool]) -> dict[str, str]:
    """Every path under root (but skipped ones) with its content's hash."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        if skip(path):
            continue
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _config() -> Entry:
    return Entry(CONFIG_FILE, b'{"peft_type": "LORA", "r": 8}')


def _weights() -> Entry:
    return Entry(WEIGHTS_FILE, b"weights")


UP = "../" * 8
# case -> (archive bytes for the `outside` dir, status, code, message fragment)
HOSTILE: dict[str, tuple[Callable[[Path], bytes], int, str, str]] = {
    "traversal-tar": (lambda out: tarred([_config(), _weights(), Entry(UP + "evil.txt", b"x")]),
                      400, "invalid_archive", "'..' path component"),
    "traversal-zip": (lambda out: zipped([Entry(f"{UP}{out.name}/{CONFIG_FILE}", b"{}"),
                                          _weights()]),
                      400, "invalid_archive", "'..' path component"),
    "absolute-tar": (lambda out: tarred([Entry(str(out / CONFIG_FILE), b"{}"), _weights()]),
                     400, "invalid_archive", "absolute path"),
    "absolute-zip": (lambda out: zipped([_config(), Entry(str(out / WEIGHTS_FILE), b"w")]),
                     400, "invalid_archive", "absolute path"),
    "symlink-tar": (lambda out: tarred([Entry(CONFIG_FILE, kind="symlink", target=str(out)),
                                        _weights()]),
                    400, "invalid_archive", "symbolic link"),
    "symlink-zip": (lambda out: zipped([_config(), Entry(WEIGHTS_FILE, kind="symlink",
                                                         target="/etc/passwd")]),
                    400, "invalid_archive", "symbolic link"),
    "hardlink-tar": (lambda out: tarred([_config(), Entry(WEIGHTS_FILE, kind="hardlink",
                                                          target="/etc/passwd")]),
                     400, "invalid_archive", "hard link"),
    "device-tar": (lambda out: tarred([_config(), _weights(), Entry("null", kind="chardev")]),
                   400, "invalid_archive", "is a device"),
    "fifo-tar": (lambda out: tarred([_config(), _weights(), Entry("pipe", kind="fifo")]),
                 400, "invalid_archive", "FIFO"),
    "bomb-tar": (lambda out: tarred([_config(), Entry(WEIGHTS_FILE, size=64 * MiB)]),
                 413, "archive_too_large", "decompression bomb"),
    "bomb-zip": (lambda out: zipped([_config(), Entry(WEIGHTS_FILE, size=64 * MiB)]),
                 413, "archive_too_large", "decompression bomb"),
    "pickle": (lambda out: zipped([_config(), Entry("adapter_model.bin", b"\x80\x04K\x01.")]),
               400, "invalid_archive", "weights are accepted only as safetensors"),
    "missing-config": (lambda out: tarred([_weights(), Entry("README.md", b"# hi")]),
                       400, "invalid_archive", "has no adapter_config.json"),
    "not-an-archive": (lambda out: b"#!/bin/sh\nrm -rf /\n", 400, "invalid_archive",
                       "neither a .zip nor a .tar.gz"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_uploads_are_refused_and_leave_nothing(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    build, status, code, message = HOSTILE[case]
    data = build(outside)
    # Anything written to the default temp dir would show up here.
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))

    def skip(path: Path) -> bool:
        return server.data_dir in path.parents or path == server.data_dir or (
            path.name.startswith("loraplex.db"))

    before, parent_before = tree(tmp_path, skip), sorted(os.listdir(tmp_path.parent))
    response = await server.upload(data, "hostile")
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == "file"
    assert message in error["message"]
    assert tree(tmp_path, skip) == before
    assert sorted(os.listdir(tmp_path.parent)) == parent_before
    assert list(system_tmp.iterdir()) == []
    assert server.temp_entries() == [] and server.stored() == []
    assert (server.count(Adapter), server.count(AdapterVersion)) == (0, 0)
    assert server.audit() == []
    assert server.engine.list_adapters() == []


async def test_a_tenant_upload_is_checked_the_same_way(server: Server) -> None:
    data = tarred([_config(), _weights(), Entry("../../evil", b"x")])
    response = await server.upload(data, role="a-writer", path="/v1/adapters")
    assert response.status_code == 400
    assert "'..' path component" in response.json()["error"]["message"]
    assert server.count(AdapterVersion) == 0


# ---------------------------------------------------------------------------- size limits


async def test_an_upload_over_the_limit_is_413_before_reading_it(server: Server) -> None:
    response = await server.upload(os.urandom(3 * MiB))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert server.temp_entries() == []
    assert server.count(AdapterVersion) == 0


async def test_a_streamed_upload_is_cut_off_at_the_limit(server: Server) -> None:
    boundary = "x-boundary-x"
    sent: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        yield (f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
               f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
               f'filename="a.zip"\r\nContent-Type: application/zip\r\n\r\n').encode()
        for _ in range(64):  # 64 MiB, without a Content-Length
            sent.append(MiB)
            yield bytes(MiB)
        yield f"\r\n--{boundary}--\r\n".encode()

    response = await server.client.post(
        "/admin/adapters", content=body(), headers={
            **ADMIN, "content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert response.status_code == 413, response.text
    limit = int(response.json()["error"]["message"].split("limit of ")[1].split(" ")[0])
    assert limit < 3 * MiB
    # Refused as soon as the file passed the limit: the rest was never read.
    assert sum(sent) <= limit + 2 * MiB
    assert server.temp_entries() == []


async def test_max_upload_bytes_applies_when_smaller(database_url: str, tmp_path: Path) -> None:
    async with running(CheckingEngine(), database_url, tmp_path / "data",
                       max_upload_bytes=64 * 1024) as server:
        response = await server.upload(zipped(archive_bytes(weights=os.urandom(100 * 1024))))
        assert response.status_code == 413
        assert "limit of 65536 bytes" in response.json()["error"]["message"]
        small = await server.upload(zipped(archive_bytes(weights=os.urandom(30 * 1024))))
        assert small.status_code == 201, small.text


async def test_uploads_skip_the_general_body_limit(database_url: str, tmp_path: Path) -> None:
    async with running(CheckingEngine(), database_url, tmp_path / "data",
                       max_body_bytes=4096) as server:
        response = await server.upload(zipped(archive_bytes(weights=os.urandom(200 * 1024))))
        assert response.status_code == 201, response.text
        other = await server.client.post("/v1/completions", headers=server.auth("a-reader"),
                                         json={"model": "x", "prompt": "y" * 8000})
        assert other.status_code == 413


async def test_the_body_limit_is_unchanged_for_other_paths_by_default() -> None:
    async def echo(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(await request.body())))

    inner = Starlette(routes=[Route(p, echo, methods=["POST"]) for p in ("/up", "/other")])
    for unlimited, expected in ((frozenset(), 413), (frozenset({"/up"}), 200)):
        app = RequestContextMiddleware(inner, max_body_bytes=1024, metrics=Metrics(FakeEngine()),
                                       unlimited_paths=unlimited)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            assert (await client.post("/up", content=b"x" * 5000)).status_code == expected
            assert (await client.post("/other", content=b"x" * 5000)).status_code == 413


# ---------------------------------------------------------------------------- valid uploads


async def test_zip_and_tar_uploads_become_versions_served_by_name(server: Server) -> None:
    first, second = archive_bytes(), archive_bytes()
    r1 = await server.upload(zipped(first), "bot")
    r2 = await server.upload(tarred([Entry("adapter", kind="dir"),
                                     *[Entry("adapter/" + e.name, e.data) for e in second]]),
                             "bot")
    r3 = await server.upload(tarred(first), "bot-copy")
    assert [r.status_code for r in (r1, r2, r3)] == [201, 201, 201], r1.text
    v1, v2, v3 = (r.json() for r in (r1, r2, r3))
    assert (v1["version"], v2["version"], v3["version"]) == (1, 2, 1)
    assert v1["status"] == v2["status"] == "ready" and v1["tenant_id"] is None
    assert v1["object"] == "adapter" and v1["report"]["rank"] == 8
    assert v1["sha256"] == v3["sha256"] != v2["sha256"]
    assert server.stored() == sorted({v1["sha256"], v2["sha256"]})
    assert [a[:2] for a in server.audit()] == [("adapter.upload", "bootstrap")] * 3
    assert server.audit()[0][2] == r1.headers["x-request-id"]
    # `bot@1` is version 1, plain `bot` the newest ready version.
    for model, version in (("bot@1", v1), ("bot", v2), ("bot@2", v2)):
        done = await server.client.post("/v1/completions", headers=server.auth("a-reader"),
                                        json={"model": model, "prompt": "hi", "max_tokens": 1})
        assert done.status_code == 200, done.text
        assert isinstance(server.engine, FakeEngine)
        assert server.engine.submitted[-1].adapter_id == f"av/{version['version_id']}"
    listing = (await server.client.get("/admin/adapters", headers=ADMIN)).json()
    assert [(a["name"], a["latest_version"], [v["version"] for v in a["versions"]])
            for a in listing["data"]] == [("bot", 2, [1, 2]), ("bot-copy", 1, [1])]
    one = await server.client.get(f"/admin/adapters/{v1['adapter_id']}", headers=ADMIN)
    assert one.json()["versions"][0]["id"] == v1["version_id"]


async def test_an_upload_answers_the_adapter_under_the_id_its_collection_serves(
    server: Server,
) -> None:
    for role, path in (("admin", "/admin/adapters"), ("a-writer", "/v1/adapters")):
        first = await server.upload(zipped(archive_bytes()), "bot", role=role, path=path)
        second = await server.upload(zipped(archive_bytes()), "bot", role=role, path=path)
        assert [r.status_code for r in (first, second)] == [201, 201], first.text
        one, two = first.json(), second.json()
        assert one["object"] == two["object"] == "adapter"
        assert one["id"] == two["id"] and one["id"].startswith("ad_")
        assert first.headers["location"] == f"{path}/{one['id']}"
        got = await server.client.get(f"{path}/{one['id']}", headers=server.auth(role))
        assert got.status_code == 200, got.text
        adapter = got.json()
        assert adapter["id"] == one["id"] and adapter["latest_version"] == 2
        assert [v["id"] for v in adapter["versions"]] == [one["version_id"], two["version_id"]]
        # The upload's own version, flat as before, and the adapter as GET shows it.
        assert (two["version"], two["status"], two["report"]["rank"]) == (2, "ready", 8)
        assert two["adapter_id"] == two["id"] and two["name"] == "bot"
        assert two["versions"] == adapter["versions"] and two["latest_version"] == 2
        gone = await server.client.delete(f"{path}/{one['id']}", headers=server.auth(role))
        assert gone.status_code == 200 and gone.json()["deleted_at"] is not None


async def test_tenant_routes_need_the_scope_and_stay_in_the_tenant(server: Server) -> None:
    data = zipped(archive_bytes())
    assert (await server.client.post("/v1/adapters")).status_code == 401
    denied = await server.upload(data, role="a-reader", path="/v1/adapters")
    assert denied.status_code == 403 and "adapters:write" in denied.json()["error"]["message"]
    assert (await server.client.get("/v1/adapters", headers=server.auth("a-reader"))
            ).status_code == 403
    admin_route = await server.upload(data, role="a-writer")
    assert admin_route.status_code == 403
    # No mass assignment: the tenant is the key's.
    smuggled = await server.upload(data, role="a-writer", path="/v1/adapters",
                                   tenant_id=server.tenants["b"])
    assert smuggled.status_code == 400
    assert smuggled.json()["error"]["param"] == "tenant_id"
    assert server.count(AdapterVersion) == 0

    mine = await server.upload(data, "mine", role="a-writer", path="/v1/adapters")
    assert mine.status_code == 201, mine.text
    body = mine.json()
    assert body["tenant_id"] == server.tenants["a"] and body["created_by"].startswith("key_")
    shared = (await server.upload(zipped(archive_bytes()), "shared-one")).json()
    own = await server.client.get("/v1/adapters", headers=server.auth("a-writer"))
    assert [a["name"] for a in own.json()["data"]] == ["mine"]
    assert (await server.client.get("/v1/adapters", headers=server.auth("b-writer"))
            ).json()["data"] == []
    for role, adapter_id in (("b-writer", body["adapter_id"]),
                             ("a-writer", shared["adapter_id"])):
        for method in ("GET", "DELETE"):
            r = await server.client.request(method, f"/v1/adapters/{adapter_id}",
                                            headers=server.auth(role))
            assert r.status_code == 404, (role, method)
    by_tenant = await server.client.get("/admin/adapters", headers=ADMIN,
                                        params={"tenant_id": server.tenants["a"]})
    assert [a["name"] for a in by_tenant.json()["data"]] == ["mine"]
    gone = await server.client.delete(f"/v1/adapters/{body['adapter_id']}",
                                      headers=server.auth("a-writer"))
    assert gone.status_code == 200 and gone.json()["deleted_at"] is not None
    assert [v["status"] for v in gone.json()["versions"]] == ["deleted"]
    assert server.engine.get_adapter(f"av/{body['version_id']}") is None


async def test_max_adapters_is_403_on_the_tenant_route(server: Server) -> None:
    for name in ("one", "two", "two"):
        r = await server.upload(zipped(archive_bytes()), name, role="a-writer",
                                path="/v1/adapters")
        assert r.status_code == 201, r.text
    over = await server.upload(zipped(archive_bytes()), "three", role="a-writer",
                               path="/v1/adapters")
    assert over.status_code == 403
    assert over.json()["error"]["code"] == "max_adapters_exceeded"


@pytest.mark.parametrize(("fields", "message"), [
    ({"name": "a/b"}, "Invalid adapter name"),
    ({"name": ""}, "Missing required form field 'name'"),
    ({"name": "x", "owner": "me"}, "Unknown form field 'owner'"),
])
async def test_form_errors(server: Server, fields: dict[str, str], message: str) -> None:
    response = await server.client.post(
        "/admin/adapters", headers=ADMIN, data=fields,
        files={"file": ("a.zip", zipped(archive_bytes()), "application/zip")},
    )
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert server.temp_entries() == []
    no_file = await server.client.post("/admin/adapters", headers=ADMIN,
                                       files={"name": (None, b"x")})
    assert no_file.status_code == 400
    assert "Missing required form field 'file'" in no_file.json()["error"]["message"]


# ---------------------------------------------------------------------------- real engine

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_RANK = 8


@dataclass
class Tiny:
    engine: AsyncEngine
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[[str], Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiny]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("uploaded_adapters")
    valid = make_peft_adapter(base, root / "valid", r=MAX_RANK, alpha=16, targets=ALL_LINEAR,
                              seed=1)
    adapters = {
        "valid": valid,
        "rank": make_peft_adapter(base, root / "rank", r=2 * MAX_RANK, seed=2),
        "dora": make_peft_adapter(base, root / "dora", r=4, seed=3, use_dora=True),
        # k/v projections of a model with 4 KV heads instead of 2.
        "shapes": make_peft_adapter(tiny_model_factory("llama_mha_untied"), root / "shapes",
                                    r=4, targets=("k_proj", "v_proj"), seed=4),
        "truncated": truncate_weights(copy_adapter(valid, root / "truncated")),
    }
    engine = AsyncEngine(EngineConfig(model=str(base), max_lora_rank=MAX_RANK, max_loras=2,
                                      max_cpu_loras=4, device="cpu", dtype="float32"))
    engine.start_sync()
    yield Tiny(engine, adapters)
    asyncio.run(engine.shutdown())


def tar_dir(adapter_dir: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(adapter_dir, arcname=adapter_dir.name)  # README.md included
    return buffer.getvalue()


def zip_dir(adapter_dir: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(adapter_dir.iterdir()):
            zf.write(path, path.name)
    return buffer.getvalue()


def test_the_engine_bound_is_the_largest_valid_adapter(tiny: Tiny) -> None:
    # Per layer, r * (in + out) for q 64+64, k 64+32, v 64+32, o 64+64, gate/up 64+128,
    # down 128+64; 2 layers, 4 bytes each, 256 header bytes per tensor, 1 MiB of slack.
    params = MAX_RANK * (128 + 96 + 96 + 128 + 192 + 192 + 192) * 2
    assert tiny.engine.max_adapter_bytes() == 4 * params + 256 * 28 + MiB
    weights = (tiny.adapters["valid"] / WEIGHTS_FILE).stat().st_size
    assert 4 * params < weights <= tiny.engine.max_adapter_bytes() - MiB


@pytest.mark.parametrize(("case", "message"), [
    ("rank", "rank 16 (layer 0 q_proj) is above the server's limit of 8"),
    ("dora", "use_dora=True asks for DoRA"),
    ("shapes", "was the adapter trained for a different base model?"),
    ("truncated", "adapter_model.safetensors is not a readable safetensors file"),
])
async def test_the_engine_refuses_what_it_cannot_serve(
    tiny: Tiny, database_url: str, tmp_path: Path, case: str, message: str
) -> None:
    async with running(tiny.engine, database_url, tmp_path / "data") as server:
        before = {a.name for a in tiny.engine.list_adapters()}
        response = await server.upload(tar_dir(tiny.adapters[case]), case)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_adapter" and message in error["message"]
        assert str(server.data_dir) not in error["message"]
        assert {a.name for a in tiny.engine.list_adapters()} == before
        [adapter] = (await server.client.get("/admin/adapters", headers=ADMIN)).json()["data"]
        [version] = adapter["versions"]
        assert (version["status"], version["report"]) == ("failed", {"error": error["message"]})
        assert adapter["latest_version"] is None
        assert server.stored() == [] and server.temp_entries() == []


async def test_a_deleted_adapter_lets_running_requests_finish(
    tiny: Tiny, database_url: str, tmp_path: Path
) -> None:
    async with running(tiny.engine, database_url, tmp_path / "data") as server:
        response = await server.upload(zip_dir(tiny.adapters["valid"]), "tiny")
        assert response.status_code == 201, response.text
        version = response.json()
        assert version["report"]["rank"] == MAX_RANK
        assert version["report"]["target_modules"] == sorted(ALL_LINEAR)
        name = f"av/{version['version_id']}"
        prompt = [300, 1200, 5000, 77, 901]
        greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)

        async def run(rid: str, adapter: str | None) -> list[int]:
            request = EngineRequest(rid, tuple(prompt), greedy, adapter=adapter)
            return [t async for out in tiny.engine.generate(request) for t in out.new_token_ids]

        expected = await run(f"{name}-before", name)
        assert expected != await run(f"{name}-base", None), "the adapter changes the answer"
        inflight = f"{name}-inflight"
        stream = tiny.engine.generate(EngineRequest(inflight, tuple(prompt), greedy, adapter=name))
        first = await anext(stream)  # running, bound to this version
        # NOTE: holding the engine's lock stops its step thread before its next step (the
        # lock is reentrant, and the delete runs on this thread): the request is surely
        # still running while the adapter is deleted.
        with tiny.engine._lock:
            assert inflight in tiny.engine._streams, "the request is not finished yet"
            deleted = await server.client.delete(f"/admin/adapters/{version['adapter_id']}",
                                                 headers=ADMIN)
            assert deleted.status_code == 200, deleted.text
            assert tiny.engine.get_adapter(name) is None
            assert inflight in tiny.engine._streams
        rest = [out async for out in stream]
        assert first.new_token_ids + [t for out in rest for t in out.new_token_ids] == expected
        assert rest[-1].finish_reason == "length"
        with pytest.raises(RequestRejected) as info:
            await run(f"{name}-after", name)
        assert info.value.code == "model_not_found"
        assert [a[0] for a in server.audit()] == ["adapter.upload", "adapter.delete"]

"""vLLM's dynamic LoRA endpoints (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)
through the whole app: vLLM's request and response shapes, imports only from the
configured directories, every hostile-upload check applied to a directory, and nothing
left behind by a refusal."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from app.registry.archive import CONFIG_FILE, WEIGHTS_FILE
from app.tables import Adapter, AdapterVersion
from tests.app.test_adapter_uploads import ADMIN, MiB, Server, running
from tests.app.test_registry import CheckingEngine

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


@pytest.fixture
def imports(tmp_path: Path) -> Path:
    root = tmp_path / "imports"
    root.mkdir()
    return root


@asynccontextmanager
async def _server(database_url: str, tmp_path: Path, imports: Path) -> AsyncIterator[Server]:
    engine = CheckingEngine(max_adapter_bytes=MiB)
    other = tmp_path / "also-allowed"
    other.mkdir()
    async with running(engine, database_url, tmp_path / "data",
                       adapter_import_dirs=f"{other}{os.pathsep}{imports}") as s:
        yield s


@pytest.fixture
async def server(database_url: str, tmp_path: Path, imports: Path) -> AsyncIterator[Server]:
    async with _server(database_url, tmp_path, imports) as s:
        yield s


@pytest.fixture
async def sqlite_server(sqlite_url: str, tmp_path: Path, imports: Path
                        ) -> AsyncIterator[Server]:
    """For what no database decides (paths, bodies): one backend is enough."""
    async with _server(sqlite_url, tmp_path, imports) as s:
        yield s


def adapter_dir(path: Path, seed: int = 0, **extra: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 8, "seed": seed}))
    (path / WEIGHTS_FILE).write_bytes(b"weights-%d" % seed)
    for name, data in extra.items():
        (path / name).write_bytes(data)
    return path


async def load(server: Server, name: str, path: Path | str, *, role: str = "admin",
               **fields: object) -> httpx.Response:
    return await server.client.post(LOAD, headers=server.auth(role),
                                    json={"lora_name": name, "lora_path": str(path), **fields})


async def unload(server: Server, name: str) -> httpx.Response:
    return await server.client.post(UNLOAD, headers=ADMIN, json={"lora_name": name})


async def test_load_serve_reload_and_unload_with_vllm_shapes(
    server: Server, imports: Path
) -> None:
    source = adapter_dir(imports / "support-bot", seed=1)
    r = await load(server, "support-bot", source)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    assert r.text == "Success: LoRA adapter 'support-bot' added successfully."
    models = (await server.client.get("/v1/models", headers=ADMIN)).json()["data"]
    assert "support-bot" in {m["id"] for m in models}
    listed = (await server.client.get("/admin/adapters", headers=ADMIN)).json()["data"]
    [adapter] = listed
    assert (adapter["name"], adapter["tenant_id"]) == ("support-bot", None)
    assert [v["version"] for v in adapter["versions"]] == [1]

    # Each pod's syncer may load it again: the same content is already there.
    r = await load(server, "support-bot", source)
    assert (r.status_code, r.text) == (
        200, "Success: LoRA adapter 'support-bot' is already loaded."
    )
    # Other content under the name: vLLM's 400, unless load_inplace makes a new version.
    changed = adapter_dir(imports / "support-bot-v2", seed=2)
    r = await load(server, "support-bot", changed)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "adapter_exists"
    r = await load(server, "support-bot", changed, load_inplace=True)
    assert r.status_code == 200, r.text
    listed = (await server.client.get("/admin/adapters", headers=ADMIN)).json()["data"]
    assert [v["version"] for v in listed[0]["versions"]] == [1, 2]
    assert server.count(AdapterVersion) == 2

    r = await unload(server, "support-bot")
    assert (r.status_code, r.text) == (
        200, "Success: LoRA adapter 'support-bot' removed successfully."
    )
    models = (await server.client.get("/v1/models", headers=ADMIN)).json()["data"]
    assert "support-bot" not in {m["id"] for m in models}
    r = await unload(server, "support-bot")
    assert r.status_code == 404
    assert "cannot be found" in r.json()["error"]["message"]
    # A loaded and an unloaded name are audited like uploads and deletions.
    assert [a for a, _, _ in server.audit()][-1] == "adapter.delete"


async def test_tenant_keys_cannot_load_or_unload(sqlite_server: Server, imports: Path
                                                 ) -> None:
    server = sqlite_server
    source = adapter_dir(imports / "x")
    for role in ("a-writer", "a-reader"):
        r = await load(server, "x", source, role=role)
        assert r.status_code in (401, 403), r.text
        r = await server.client.post(UNLOAD, headers=server.auth(role), json={"lora_name": "x"})
        assert r.status_code in (401, 403), r.text
    assert server.count(Adapter) == 0


async def test_loads_from_a_path_are_off_without_import_dirs(
    database_url: str, tmp_path: Path
) -> None:
    source = adapter_dir(tmp_path / "adapter")
    async with running(CheckingEngine(max_adapter_bytes=MiB), database_url,
                       tmp_path / "data") as server:
        r = await load(server, "x", source)
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "imports_disabled"
        assert "LORAPLEX_ADAPTER_IMPORT_DIRS" in r.json()["error"]["message"]
        assert server.count(Adapter) == 0


def _link_out(root: Path, outside: Path) -> Path:
    (root / "link").symlink_to(adapter_dir(outside / "secret"), target_is_directory=True)
    return root / "link"


def _file_link(root: Path, outside: Path) -> Path:
    d = adapter_dir(root / "d")
    (d / WEIGHTS_FILE).unlink()
    (d / WEIGHTS_FILE).symlink_to(adapter_dir(outside / "w") / WEIGHTS_FILE)
    return d


def _hard_link(root: Path, outside: Path) -> Path:
    d = adapter_dir(root / "d")
    (d / WEIGHTS_FILE).unlink()
    os.link(adapter_dir(outside / "w") / WEIGHTS_FILE, d / WEIGHTS_FILE)
    return d


def _fifo(root: Path, outside: Path) -> Path:
    d = adapter_dir(root / "d")
    os.mkfifo(d / "pipe")
    return d


def _nested(root: Path, outside: Path) -> Path:
    d = adapter_dir(root / "d")
    adapter_dir(d / "inner" / "deeper")
    return d


# case -> (build the lora_path under the import root, status, code, message fragment)
HOSTILE: dict[str, tuple[Callable[[Path, Path], Path | str], int, str, str]] = {
    "outside-the-roots": (lambda root, out: adapter_dir(out / "a"), 403, "path_not_allowed",
                          "must lie under one of the import directories"),
    "dot-dot-out": (lambda root, out: f"{adapter_dir(out / 'a')}/../../{root.name}/../outside/a",
                    403, "path_not_allowed", "import directories"),
    "link-leading-out": (_link_out, 403, "path_not_allowed", "import directories"),
    "relative": (lambda root, out: "imports/a", 400, "invalid_request_error", "absolute path"),
    "not-a-directory": (lambda root, out: adapter_dir(root / "a") / CONFIG_FILE, 400,
                        "invalid_request_error", "not a directory"),
    "symlinked-file": (_file_link, 400, "invalid_archive", "symbolic link"),
    "hard-linked-file": (_hard_link, 400, "invalid_archive", "hard link"),
    "fifo": (_fifo, 400, "invalid_archive", "FIFO"),
    "nested": (_nested, 400, "invalid_archive", "nested"),
    "pickle": (lambda root, out: adapter_dir(root / "d", **{"adapter_model.bin": b"\x80\x04."}),
               400, "invalid_archive", "pickle"),
    "missing-weights": (lambda root, out: _without(adapter_dir(root / "d"), WEIGHTS_FILE),
                        400, "invalid_archive", f"has no {WEIGHTS_FILE}"),
    "too-large": (lambda root, out: adapter_dir(root / "d", **{WEIGHTS_FILE: b"\0" * 3 * MiB}),
                  413, "archive_too_large", "decompression bomb"),
    "refused-by-engine": (lambda root, out: _config(adapter_dir(root / "d"), use_dora=True),
                          422, "invalid_adapter", "DoRA"),
}


def _without(d: Path, name: str) -> Path:
    (d / name).unlink()
    return d


def _config(d: Path, **fields: object) -> Path:
    (d / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 8, **fields}))
    return d


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_loads_are_refused_and_leave_nothing(
    sqlite_server: Server, imports: Path, tmp_path: Path, case: str
) -> None:
    server = sqlite_server
    outside = tmp_path / "outside"
    outside.mkdir()
    build, status, code, message = HOSTILE[case]
    r = await load(server, "hostile", build(imports, outside))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code or error["type"] == code, error
    assert error["param"] == "lora_path"
    assert message in error["message"]
    assert server.temp_entries() == []
    if case != "refused-by-engine":  # kept as a failed version, as an upload's would be
        assert server.stored() == []
        assert (server.count(Adapter), server.count(AdapterVersion)) == (0, 0)
    assert server.engine.list_adapters() == []


BAD_BODIES = [(LOAD, body) for body in (
    {}, {"lora_name": "x"}, {"lora_path": "/tmp"}, {"lora_name": "", "lora_path": "/tmp"},
    {"lora_name": "x", "lora_path": "/tmp", "surprise": 1},
    {"lora_name": 3, "lora_path": "/tmp"}, {"lora_name": "x", "lora_path": ["/tmp"]},
    {"lora_name": "x", "lora_path": "/" + "a" * 5000},
    {"lora_name": "x", "lora_path": "/tmp/\u0000x"},
    {"lora_name": "../x", "lora_path": "/tmp"}, {"lora_name": "a/b", "lora_path": "/tmp"},
    {"lora_name": "x", "lora_path": "/tmp", "load_inplace": "maybe"},
)] + [(UNLOAD, body) for body in (
    {}, {"lora_name": ""}, {"lora_name": "x", "other": 1}, {"lora_name": ["x"]},
)]


@pytest.mark.parametrize(("path", "body"), BAD_BODIES)
async def test_bad_bodies_are_400(sqlite_server: Server, path: str, body: dict[str, object]
                                  ) -> None:
    r = await sqlite_server.client.post(path, headers=ADMIN, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert sqlite_server.count(Adapter) == 0

"""What the service mounts beside its API comes from the packages installed, not from an
import in the app: the admin UI is found by its entry point and added by create_app."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

import admin_ui
from app.core.config import Settings
from app.main import Mount, create_app
from app.server_options import installed_mounts
from tests.utils.fake_engine import FakeEngine, asgi_client, shared_data_dir


def test_the_admin_ui_is_installed_as_a_mount() -> None:
    assert installed_mounts() == [admin_ui.MOUNT]
    assert admin_ui.MOUNT.upload_paths == admin_ui.UPLOAD_PATHS


def _settings() -> Settings:
    return Settings(no_auth=True, data_dir=shared_data_dir(), max_body_bytes=1024)


async def test_an_app_without_mounts_has_no_admin_ui() -> None:
    async with asgi_client(create_app(FakeEngine(), _settings())) as client:
        assert (await client.get("/admin/ui/login")).status_code == 404
        assert (await client.get("/v1/models")).status_code == 200


async def test_a_mount_adds_its_routes_and_its_upload_paths_escape_the_body_limit() -> None:
    def install(app: FastAPI) -> None:
        @app.post("/extra/upload")
        async def upload() -> PlainTextResponse:
            return PlainTextResponse("ok")

        @app.post("/extra/small")
        async def small() -> PlainTextResponse:
            return PlainTextResponse("ok")

    mount = Mount(name="extra", install=install, upload_paths=frozenset({"/extra/upload"}))
    async with asgi_client(create_app(FakeEngine(), _settings(), mounts=[mount])) as client:
        big = b"x" * 4096
        assert (await client.post("/extra/upload", content=big)).status_code == 200
        assert (await client.post("/extra/small", content=big)).status_code == 413
        assert (await client.post("/extra/small", content=b"x")).status_code == 200


async def test_the_admin_ui_mount_serves_its_login_page() -> None:
    app = create_app(FakeEngine(), _settings(), mounts=installed_mounts())
    async with asgi_client(app) as client:
        page = await client.get("/admin/ui/login")
    assert page.status_code == 200
    assert "text/html" in page.headers["content-type"]


def test_a_wrong_entry_point_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Point:
        name, value = "bad", "somewhere:THING"

        def load(self) -> object:
            return object()

    monkeypatch.setattr("app.server_options.entry_points", lambda group: [Point()])
    with pytest.raises(TypeError, match="entry point bad"):
        installed_mounts()

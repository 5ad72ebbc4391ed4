"""The admin UI's pages over HTTP on SQLite and PostgreSQL: what a user gets wrong comes
back as the form's page with a clear message and the right status, nothing half-done;
changes are audited under the admin's actor as the admin API audits them."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from admin_ui import MOUNT
from app.core.config import Settings
from app.main import create_app
from tests.admin_ui.pages import UI, csrf_of, login
from tests.utils.fake_engine import FakeEngine, asgi_client
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer

ADMIN = bearer(ADMIN_KEY)


@dataclass
class Admin:
    client: httpx.AsyncClient
    token: str
    engine: FakeEngine

    async def post(self, path: str, **data: str) -> httpx.Response:
        return await self.client.post(UI + path, data={"csrf_token": self.token, **data})


@pytest.fixture
async def admin(database_url: str, tmp_path: Path) -> AsyncIterator[Admin]:
    settings = Settings(data_dir=tmp_path / "data", database_url=database_url,
                        admin_key=ADMIN_KEY, secret_key=SECRET_KEY)
    # Room for the tools prompt of the playground's tool call.
    engine = FakeEngine(max_model_len=1024)
    async with asgi_client(create_app(engine, settings, mounts=[MOUNT])) as client:
        assert (await login(client, ADMIN_KEY)).status_code == 303
        yield Admin(client, await csrf_of(client), engine)


def _tenant(name: str, **fields: str) -> dict[str, str]:
    return {"name": name, "tier": "standard", "isolation": "shared", "plan": "", **fields}


async def test_tenant_form_errors_are_shown_on_the_form(admin: Admin) -> None:
    assert (await admin.post("/tenants", **_tenant("acme"))).status_code == 303
    cases = [
        (_tenant("acme"), 409, "already exists"),
        (_tenant("bad", rpm="lots"), 400, "whole number"),
        (_tenant("bad", rpm="0"), 400, "rpm"),
        (_tenant(" "), 400, "name"),
        (_tenant("bad", tier="gold"), 400, "tier"),
        (_tenant("bad", plan="no-such-plan"), 400, "No price plan named"),
    ]
    for form, status, message in cases:
        response = await admin.post("/tenants", **form)
        assert response.status_code == status, (form, response.text)
        assert message in response.text, (form, response.text)
        assert 'role="alert"' in response.text
        # The form keeps what was typed.
        assert f'value="{form["name"]}"' in response.text or not form["name"].strip()
    listed = await admin.client.get("/admin/tenants", headers=ADMIN)
    assert [t["name"] for t in listed.json()["data"]] == ["acme"]


async def test_editing_a_tenant_is_audited_like_the_api(admin: Admin) -> None:
    created = await admin.post("/tenants", **_tenant("acme", rpm="60", tpm="1000"))
    tenant_id = created.headers["location"].split("/")[-1].split("?")[0]
    # Emptied quotas become unlimited; the checkbox disables.
    saved = await admin.post(f"/tenants/{tenant_id}", tier="premium", isolation="dedicated",
                             plan="", rpm="120", disabled="on")
    assert saved.status_code == 303, saved.text
    tenant = (await admin.client.get(f"/admin/tenants/{tenant_id}", headers=ADMIN)).json()
    assert (tenant["tier"], tenant["isolation"], tenant["disabled"]) == (
        "premium", "dedicated", True)
    assert tenant["quotas"]["rpm"] == 120 and tenant["quotas"]["tpm"] is None
    audit = (await admin.client.get(
        f"/admin/audit?target_id={tenant_id}", headers=ADMIN)).json()["data"]
    assert [(row["action"], row["actor"]) for row in audit] == [
        ("tenant.update", "bootstrap"), ("tenant.create", "bootstrap")]
    assert audit[0]["details"]["changes"]["rpm"] == [60, 120]
    bad = await admin.post(f"/tenants/{tenant_id}", tier="premium", isolation="shared",
                           plan="", rpm="-5")
    assert bad.status_code == 400 and "rpm" in bad.text


async def test_a_new_key_is_shown_once_and_works(admin: Admin) -> None:
    created = await admin.post("/tenants", **_tenant("acme"))
    tenant_id = created.headers["location"].split("/")[-1].split("?")[0]
    page = await admin.client.post(
        f"{UI}/tenants/{tenant_id}/keys",
        data={"csrf_token": admin.token, "name": "ci", "scopes": ["inference", "adapters:write"]},
    )
    assert page.status_code == 200, page.text
    key = page.text.split('id="created-key" class="secret" readonly value="', 1)[1].split('"')[0]
    models = await admin.client.get("/v1/models", headers=bearer(key))
    assert models.status_code == 200
    again = await admin.client.get(f"{UI}/tenants/{tenant_id}/keys")
    assert key not in again.text and key[:12] in again.text  # the prefix only
    keys = (await admin.client.get(f"/admin/tenants/{tenant_id}/keys", headers=ADMIN)).json()
    assert keys["data"][0]["scopes"] == ["inference", "adapters:write"]
    assert keys["data"][0]["created_by"] == "bootstrap"
    past = await admin.client.post(
        f"{UI}/tenants/{tenant_id}/keys",
        data={"csrf_token": admin.token, "name": "old", "expires_on": "2001-01-01"},
    )
    assert past.status_code == 400 and "must be in the future" in past.text


async def test_unknown_objects_and_bad_queries_get_pages(admin: Admin) -> None:
    for path in ("/tenants/ten_missing", "/tenants/ten_missing/keys", "/adapters/ad_missing",
                 "/invoices/inv_missing"):
        response = await admin.client.get(UI + path)
        assert response.status_code == 404, path
        assert "text/html" in response.headers["content-type"]
        assert "No " in response.text
    usage = await admin.client.get(f"{UI}/usage?start=2026-03-10&end=2026-03-01")
    assert usage.status_code == 400 and "must be after" in usage.text
    plain = await admin.client.get(f"{UI}/usage?start=2026-03-01&end=2026-03-31&group_by=key")
    assert plain.status_code == 200 and "No usage in this range." in plain.text
    csv_file = await admin.client.get(f"{UI}/usage.csv?start=2026-03-01&end=2026-03-31")
    assert csv_file.status_code == 200
    assert csv_file.headers["content-type"].startswith("text/csv")
    assert "usage-all-20260301-20260401.csv" in csv_file.headers["content-disposition"]
    # The API itself still answers in JSON.
    api = await admin.client.get("/admin/tenants/ten_missing", headers=ADMIN)
    assert api.status_code == 404 and api.json()["error"]["code"] == "not_found"
    no_plan = await admin.post("/tenants", **_tenant("acme"))
    tenant_id = no_plan.headers["location"].split("/")[-1].split("?")[0]
    invoice = await admin.post("/invoices", tenant_id=tenant_id, period="2026-03")
    assert invoice.status_code == 400 and "has no price plan" in invoice.text


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(f"adapter/{name}", data)
    return buffer.getvalue()


async def test_upload_then_delete_an_adapter(admin: Admin) -> None:
    created = await admin.post("/tenants", **_tenant("acme"))
    tenant_id = created.headers["location"].split("/")[-1].split("?")[0]
    scripted = {"X-CSRF-Token": admin.token, "Accept": "application/json"}
    good = _zip({"adapter_config.json": b'{"peft_type": "LORA", "r": 8}',
                 "adapter_model.safetensors": b"weights"})
    uploaded = await admin.client.post(
        f"{UI}/adapters/upload", headers=scripted,
        files={"file": ("a.zip", good, "application/zip")},
        data={"name": "bot", "tenant_id": tenant_id},
    )
    assert uploaded.status_code == 201, uploaded.text
    body = uploaded.json()
    assert (body["name"], body["tenant_id"], body["status"]) == ("bot", tenant_id, "ready")
    assert body["created_by"] == "bootstrap"
    # Refusals come back as the API's JSON errors, for the page's script to show.
    bad = await admin.client.post(
        f"{UI}/adapters/upload", headers=scripted,
        files={"file": ("a.zip", b"not a zip", "application/zip")}, data={"name": "bot2"},
    )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "file"

    page = await admin.client.get(f"{UI}/adapters/{body['adapter_id']}")
    assert page.status_code == 200 and "acme" in page.text and ">ready<" in page.text
    deleted = await admin.post(f"/adapters/{body['adapter_id']}/delete")
    assert deleted.status_code == 303
    listed = await admin.client.get("/admin/adapters", headers=ADMIN)
    assert listed.json()["data"] == []
    audit = (await admin.client.get(
        f"/admin/audit?target_id={body['adapter_id']}", headers=ADMIN)).json()["data"]
    assert {row["actor"] for row in audit} == {"bootstrap"}


async def test_the_playground_acts_for_the_chosen_tenant(admin: Admin) -> None:
    ids = []
    for name in ("acme", "globex"):
        created = await admin.post("/tenants", **_tenant(name))
        ids.append(created.headers["location"].split("/")[-1].split("?")[0])
    archive = _zip({"adapter_config.json": b'{"peft_type": "LORA", "r": 8}',
                    "adapter_model.safetensors": b"weights"})
    uploaded = await admin.client.post(
        f"{UI}/adapters/upload", headers={"X-CSRF-Token": admin.token},
        files={"file": ("a.zip", archive, "application/zip")},
        data={"name": "bot", "tenant_id": ids[0]},
    )
    assert uploaded.status_code == 201, uploaded.text
    run = {"adapter": "bot", "prompt": "Hi", "max_tokens": "10"}
    own = await admin.post("/playground", tenant_id=ids[0], **run)
    assert own.status_code == 200, own.text
    assert own.text.count('<pre class="answer-text">&lt;|user|&gt;Hi') == 2
    # Another tenant's adapter does not resolve, as on the API.
    other = await admin.post("/playground", tenant_id=ids[1], **run)
    assert other.status_code == 200
    assert other.text.count('<pre class="answer-text">') == 1
    assert "does not exist or you do not have access" in other.text
    missing = await admin.post("/playground", tenant_id="ten_nobody", **run)
    assert missing.status_code == 400 and "Choose a tenant." in missing.text


async def test_the_playground_tries_a_json_schema_and_a_tool(admin: Admin) -> None:
    created = await admin.post("/tenants", **_tenant("acme"))
    tenant_id = created.headers["location"].split("/")[-1].split("?")[0]
    archive = _zip({"adapter_config.json": b'{"peft_type": "LORA", "r": 8}',
                    "adapter_model.safetensors": b"weights"})
    uploaded = await admin.client.post(
        f"{UI}/adapters/upload", headers={"X-CSRF-Token": admin.token},
        files={"file": ("a.zip", archive, "application/zip")},
        data={"name": "bot", "tenant_id": tenant_id},
    )
    assert uploaded.status_code == 201, uploaded.text
    page = await admin.client.get(UI + "/playground")
    assert 'name="output"' in page.text and 'name="spec"' in page.text
    run = {"tenant_id": tenant_id, "adapter": "bot", "prompt": "Hi", "max_tokens": "10"}
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    answered = await admin.post("/playground", output="json_schema", spec=json.dumps(schema),
                                **run)
    assert answered.status_code == 200, answered.text
    specs = [s.sampling.structured for s in admin.engine.submitted[-2:]]
    # Both answers (base model and adapter) ran under the schema, strict.
    assert all(spec is not None and spec.kind == "json_schema" and spec.strict
               and json.loads(spec.text) == schema for spec in specs), specs
    function = {"name": "get_weather", "parameters": schema}
    answered = await admin.post("/playground", output="tool", spec=json.dumps(function), **run)
    assert answered.status_code == 200, answered.text
    specs = [s.sampling.structured for s in admin.engine.submitted[-2:]]
    assert all(spec is not None and spec.kind == "grammar" and "get_weather" in spec.text
               for spec in specs), specs
    for spec, message in [("{not json", "is not valid JSON"), ("[1]", "must be a JSON object")]:
        refused = await admin.post("/playground", output="json_schema", spec=spec, **run)
        assert refused.status_code == 400 and message in refused.text, refused.text
    bad_tool = await admin.post("/playground", output="tool",
                                spec=json.dumps({"name": "bad name!"}), **run)
    assert "Invalid function name" in bad_tool.text

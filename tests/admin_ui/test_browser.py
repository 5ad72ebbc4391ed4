"""The admin UI in a real headless Chromium (Playwright) against the real app served by
uvicorn (FakeEngine, SQLite): log in, create a tenant and a key, upload a PEFT adapter
and see it validated, try it in the playground, see the `openai` client's calls in the
usage chart, table and CSV, generate, download and finalize an invoice that matches the
admin API; a wrong key cannot log in and a POST without the CSRF token changes nothing.

Every page is saved to test-artifacts/screenshots/<page>.png.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from playwright.sync_api import Browser, BrowserContext, Page, expect, sync_playwright

from admin_ui import MOUNT
from app.core.config import Settings
from app.main import create_app
from engine.client import AdapterInfo
from tests.utils.fake_engine import FakeEngine
from tests.utils.live_server import serve_in_thread
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer, tar_gz

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
UI = "/admin/ui"
ADMIN = bearer(ADMIN_KEY)
PLAN = {
    "name": "standard-usd", "currency": "USD", "prompt_per_mtok": "1000.00",
    "completion_per_mtok": "2000.00", "cached_prompt_per_mtok": "500.00",
    "adapter_month": "30.00", "monthly_minimum": "0",
}
# Expect's default wait, for pages that wait on the server.
WAIT_MS = 15_000


class PeftReadingEngine(FakeEngine):
    """A FakeEngine that validates adapters as PEFT wrote them: the config's rank,
    alpha and targets, and a weights file holding lora_A/lora_B tensors of that rank."""

    async def add_adapter(self, name: str, path: str) -> AdapterInfo:
        from safetensors import safe_open

        from engine.lora.weights import AdapterError

        directory = Path(path)
        try:
            config = json.loads((directory / "adapter_config.json").read_text())
            with safe_open(str(directory / "adapter_model.safetensors"), "pt") as weights:
                shapes = {k: weights.get_slice(k).get_shape() for k in weights.keys()}  # noqa: SIM118
        except (OSError, ValueError) as exc:
            raise AdapterError(f"{directory}: {exc}") from exc
        rank = int(config["r"])
        lora_a = [s for k, s in shapes.items() if k.endswith("lora_A.weight")]
        if not lora_a or any(s[0] != rank for s in lora_a):
            raise AdapterError(f"{directory}: no lora_A tensors of rank {rank}")
        info = await super().add_adapter(name, path)
        self.adapters[name] = info = AdapterInfo(
            name=name, key=info.key, path=path, rank=rank, alpha=float(config["lora_alpha"]),
            use_rslora=bool(config.get("use_rslora")),
            target_modules=tuple(sorted(config["target_modules"])),
            size_bytes=sum(4 * a * b for a, b in shapes.values()), created=info.created,
        )
        return info


def _peft_archive(root: Path) -> Path:
    """A .tar.gz of a real PEFT adapter (peft's save_pretrained) for a tiny Llama."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.utils.peft_adapters import make_peft_adapter

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    adapter = make_peft_adapter(root / "base", root / "adapter", r=4, alpha=8, seed=3,
                                base_model=model)
    archive = root / "support-bot.tar.gz"
    archive.write_bytes(tar_gz(adapter))
    return archive


@dataclass
class Service:
    url: str
    engine: PeftReadingEngine
    archive: Path

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=ADMIN, timeout=30)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("admin_ui")
    archive = _peft_archive(root)
    engine = PeftReadingEngine(max_model_len=512)
    settings = Settings(
        data_dir=root / "data", database_url=f"sqlite:///{root / 'ui.db'}",
        admin_key=ADMIN_KEY, secret_key=SECRET_KEY, usage_flush_interval_s=0.05,
    )
    with serve_in_thread(create_app(engine, settings, mounts=[MOUNT])) as url:
        service = Service(url, engine, archive)
        with service.api() as api:
            assert api.post("/admin/plans", json=PLAN).status_code == 201
        yield service


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def context(service: Service, browser: Browser) -> Iterator[BrowserContext]:
    context = browser.new_context(base_url=service.url, accept_downloads=True,
                                  viewport={"width": 1280, "height": 900})
    context.set_default_timeout(WAIT_MS)
    try:
        yield context
    finally:
        context.close()


def _shot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def _log_in(page: Page) -> None:
    page.goto(f"{UI}/")
    expect(page).to_have_url(f"{page.url.split('/admin')[0]}{UI}/login?next=%2Fadmin%2Fui%2F")
    page.get_by_label("Admin key").fill(ADMIN_KEY)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Overview")


def _nav(page: Page, name: str) -> None:
    page.get_by_role("navigation", name="Main").get_by_role("link", name=name).click()
    expect(page.get_by_role("heading", level=1)).to_have_text(name)


def _download(page: Page, link: str) -> str:
    with page.expect_download() as info:
        page.locator(link).click()
    path = info.value.path()
    return Path(path).read_text()


def _until(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# --------------------------------------------------------------------------- the journey


SHOTS = ("login", "overview", "tenants", "tenant", "keys", "adapters", "adapter", "playground",
         "usage", "invoice", "invoices")


def test_admin_journey(service: Service, context: BrowserContext) -> None:
    for name in SHOTS:  # so that only this run's screenshots can pass
        (SCREENSHOTS / f"{name}.png").unlink(missing_ok=True)
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto(f"{UI}/login")
    _shot(page, "login")
    _log_in(page)
    expect(page.locator("#overview-chart-1 svg")).to_be_visible()
    expect(page.locator("#engine ~ dl").first).to_contain_text("fake-model")

    # A tenant, created and then edited.
    _nav(page, "Tenants")
    page.get_by_label("Name").fill("acme")
    page.get_by_label("Tier").select_option("premium")
    page.get_by_label("Price plan").select_option("standard-usd")
    page.get_by_label("Requests per minute").fill("600")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.get_by_role("status")).to_have_text("Tenant created.")
    tenant_id = page.locator("#tenant-id").inner_text()
    page.get_by_label("Tier").select_option("batch")
    page.get_by_label("Max tokens per request").fill("256")
    page.get_by_role("button", name="Save changes").click()
    expect(page.get_by_role("status")).to_have_text("Changes saved.")
    _shot(page, "tenant")
    with service.api() as api:
        tenant = api.get(f"/admin/tenants/{tenant_id}").json()
    assert (tenant["name"], tenant["tier"], tenant["plan"]) == ("acme", "batch", "standard-usd")
    assert tenant["quotas"]["rpm"] == 600 and tenant["quotas"]["max_tokens"] == 256

    _nav(page, "Tenants")
    row = page.locator("#tenants-table tr", has_text="acme")
    expect(row).to_contain_text("standard-usd")
    _shot(page, "tenants")

    # Keys: one shown once, one revoked.
    row.get_by_role("link", name="API keys").click()
    shown = {}
    for name in ("old", "prod"):
        page.get_by_label("Name").fill(name)
        page.get_by_role("button", name="Create key").click()
        expect(page.get_by_role("status")).to_contain_text(f"Key '{name}' created")
        shown[name] = page.get_by_label("Key", exact=True).input_value()
    key = shown["prod"]
    assert key.startswith("lpx_t_") and shown["old"] != key
    page.get_by_role("button", name="Revoke key old").click()
    expect(page.get_by_role("status")).to_contain_text("revoked")
    expect(page.locator("#keys-table")).to_contain_text("revoked")
    _shot(page, "keys")
    assert key not in page.content()  # shown once only

    # An adapter, uploaded with progress and validated.
    _nav(page, "Adapters")
    page.get_by_label("Archive").set_input_files(str(service.archive))
    page.get_by_label("Name").fill("support-bot")
    page.get_by_label("Owner").select_option(label="acme")
    page.get_by_role("button", name="Upload").click()
    report = page.locator("#upload-report")
    expect(report).to_be_visible()
    expect(report).to_contain_text("ready")
    expect(report).to_contain_text("q_proj, v_proj")
    assert page.locator("#upload-progress").evaluate("p => p.value") == 100
    expect(page.get_by_role("status")).to_have_text("Adapter support-bot version 1 is ready.")
    expect(page.locator("#adapters-table tr[data-adapter='support-bot']")).to_contain_text("ready")
    _shot(page, "adapters")
    page.locator("#upload-report-link").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Adapter support-bot")
    expect(page.locator("#versions-table")).to_contain_text("q_proj, v_proj")
    expect(page.locator("#versions-table")).to_contain_text("current")
    expect(page.locator("#current-version")).to_have_text("1")
    expect(page.locator("#gate")).to_have_text("off")
    expect(page.locator("#evals")).to_be_visible()
    assert page.locator("#eval-chart").count() == 0  # no eval yet

    # An eval of the version (started through the admin API), on the adapter's page:
    # one item every answer passes, one none does.
    items = ({"prompt": "Say hi", "expected": ".*", "match": "regex"},
             {"prompt": "Say hi", "expected": "never this"})
    adapter_id = page.url.rsplit("/", 1)[-1]
    with service.api() as admin:
        started = admin.post(f"/admin/adapters/{adapter_id}/evals",
                             content="\n".join(json.dumps(i) for i in items),
                             headers={"Content-Type": "application/jsonl"})
        assert started.status_code == 202, started.text
        deadline = time.monotonic() + 30
        while admin.get(f"/admin/adapters/{adapter_id}/evals/{started.json()['id']}"
                        ).json()["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
    page.reload()
    evals = page.locator("#evals-table")
    expect(evals).to_contain_text("done")
    expect(evals).to_contain_text("50.0%")
    expect(page.locator("#eval-chart rect.bar")).to_have_count(2)  # v1 and the base model
    _shot(page, "adapter")

    # The playground: base model and adapter side by side, for the tenant.
    _nav(page, "Playground")
    page.get_by_label("Tenant").select_option(label="acme")
    page.get_by_label("Adapter").select_option("support-bot")
    page.get_by_label("Prompt").fill("Say hi")
    page.get_by_label("Max tokens").fill("14")
    submitted = len(service.engine.submitted)
    page.get_by_role("button", name="Run on both").click()
    for side in ("base", "adapter"):
        expect(page.locator(f"#answer-{side} pre")).to_have_text("<|user|>Say hi")
    ran = service.engine.submitted[submitted:]
    assert [r.adapter_id is None for r in ran] == [True, False]
    assert ran[1].adapter_id is not None and ran[1].adapter_id.startswith("av/")
    _shot(page, "playground")

    # Calls through the real `openai` client, with the key the UI showed.
    revoked = openai.OpenAI(base_url=f"{service.url}/v1", api_key=shown["old"], max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        revoked.models.list()
    client = openai.OpenAI(base_url=f"{service.url}/v1", api_key=key, max_retries=0)
    tokens = 0
    for model in ("support-bot", "support-bot", "fake-model"):
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
        )
        assert response.usage is not None
        tokens += response.usage.total_tokens

    _nav(page, "Usage")
    page.get_by_label("Tenant").select_option(label="acme")
    page.get_by_label("Group by").select_option("day")

    def shows_all_calls() -> bool:
        page.get_by_role("button", name="Show usage").click()
        return page.locator("#usage-totals td").first.inner_text() == "3"

    _until(shows_all_calls, "the usage rows")
    totals = page.locator("#usage-totals td").all_inner_texts()
    assert totals[7] == f"{tokens:,}"
    today = time.strftime("%Y-%m-%d", time.gmtime())
    bar = page.locator(f"#usage-chart-1 rect[data-label='{today}']")
    assert bar.get_attribute("data-value") == "3"
    assert float(bar.get_attribute("height") or 0) > 0
    _shot(page, "usage")
    rows = list(csv.DictReader(io.StringIO(_download(page, "#usage-csv"))))
    assert rows[-1]["tenant_id"] == "total" and rows[-1]["requests"] == "3"
    assert rows[-1]["total_tokens"] == str(tokens)
    page.get_by_label("Group by").select_option("adapter")
    page.get_by_role("button", name="Show usage").click()
    table = page.locator("#usage-table tbody")
    expect(table.locator("tr", has_text="support-bot")).to_contain_text("2")
    expect(table.locator("tr", has_text="base model")).to_contain_text("1")

    # The overview's charts show today's traffic (the playground's two runs are the
    # admin's own, under no tenant).
    _nav(page, "Overview")
    bar = page.locator(f"#overview-chart-1 rect[data-label='{today}']")
    assert bar.get_attribute("data-value") == "5"
    _shot(page, "overview")

    # An invoice for this month, as the admin API has it.
    _nav(page, "Invoices")
    page.get_by_label("Tenant", exact=True).select_option(label="acme")
    page.get_by_role("button", name="Generate").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("Invoice ")
    invoice_id = page.locator("#invoice-id").inner_text()
    shown_total = page.locator("#invoice-total").inner_text()
    with service.api() as api:
        api_invoice: dict[str, Any] = api.get(f"/admin/invoices/{invoice_id}").json()
    assert shown_total == api_invoice["total"] and float(shown_total) > 0
    _shot(page, "invoice")
    downloaded = json.loads(_download(page, "#invoice-json"))
    assert downloaded["total"] == api_invoice["total"]
    assert downloaded["lines"] == api_invoice["lines"]
    lines = list(csv.reader(io.StringIO(_download(page, "#invoice-csv"))))
    assert any(api_invoice["total"] in row for row in lines)
    page.get_by_role("button", name="Finalize invoice").click()
    expect(page.locator("#invoice-status")).to_have_text("final")
    with service.api() as api:
        assert api.get(f"/admin/invoices/{invoice_id}").json()["status"] == "final"
    with context.expect_page() as printed:
        page.locator("#invoice-print").click()
    printed.value.wait_for_load_state()
    assert api_invoice["total"] in printed.value.content()
    printed.value.close()
    _nav(page, "Invoices")
    expect(page.locator("#invoices-table")).to_contain_text(api_invoice["total"])
    _shot(page, "invoices")

    for name in SHOTS:
        data = (SCREENSHOTS / f"{name}.png").read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, name


# ------------------------------------------------------------------------------ refusals


def test_a_wrong_admin_key_cannot_log_in(service: Service, context: BrowserContext) -> None:
    page = context.new_page()
    page.goto(f"{UI}/login")
    page.get_by_label("Admin key").fill("not-the-admin-key-0123456789")
    with page.expect_response(lambda r: r.request.method == "POST") as answer:
        page.get_by_role("button", name="Log in").click()
    assert answer.value.status == 401
    expect(page.get_by_role("alert")).to_contain_text("Login failed")
    assert "lpx_admin_session" not in {c["name"] for c in context.cookies()}
    page.goto(f"{UI}/tenants")
    expect(page.get_by_role("heading", level=1)).to_have_text("Log in")


def test_a_post_without_the_csrf_token_is_refused(service: Service,
                                                   context: BrowserContext) -> None:
    page = context.new_page()
    _log_in(page)
    post = """async ([token]) => {
        const body = new URLSearchParams({name: token ? "csrf-ok" : "csrf-victim",
                                          tier: "standard", isolation: "shared", plan: ""});
        const headers = token ? {"X-CSRF-Token": token} : {};
        const response = await fetch("/admin/ui/tenants", {method: "POST", body, headers});
        return response.status;
    }"""
    assert page.evaluate(post, [None]) == 403
    token = page.locator('meta[name="csrf-token"]').get_attribute("content")
    assert page.evaluate(post, [token]) == 200  # 303, followed to the tenant's page
    with service.api() as api:
        names = {t["name"] for t in api.get("/admin/tenants").json()["data"]}
    assert "csrf-ok" in names and "csrf-victim" not in names


# ------------------------------------------------------------------------- accessibility


# Controls a person must be told the purpose of, and how each page can fall short.
_AUDIT_JS = """() => {
  const problems = [];
  const named = (el) => (el.getAttribute('aria-label') || el.getAttribute('aria-labelledby')
                         || (el.labels && el.labels.length > 0));
  for (const el of document.querySelectorAll('input, select, textarea')) {
    if (['hidden', 'submit', 'button'].includes(el.type)) continue;
    if (!named(el)) problems.push('unlabelled ' + el.tagName + ' ' + (el.name || el.id));
  }
  for (const el of document.querySelectorAll('button, a[href]')) {
    const text = (el.textContent || '').trim() || el.getAttribute('aria-label');
    if (!text) problems.push('nameless ' + el.tagName + ' ' + el.outerHTML.slice(0, 80));
  }
  for (const svg of document.querySelectorAll('main svg')) {
    const titled = svg.getAttribute('aria-label') || svg.querySelector('title')
                   || svg.getAttribute('aria-labelledby');
    if (svg.getAttribute('aria-hidden') !== 'true' && !(svg.getAttribute('role') === 'img'
        && titled)) problems.push('chart without a text alternative');
  }
  if (document.querySelectorAll('h1').length !== 1) problems.push('not exactly one h1');
  if (!document.documentElement.lang) problems.push('no lang on <html>');
  if (!document.querySelector('main')) problems.push('no <main> landmark');
  if (!document.querySelector('nav[aria-label]')) problems.push('no labelled <nav>');
  const ids = [...document.querySelectorAll('[id]')].map((el) => el.id);
  const dupes = ids.filter((id, i) => ids.indexOf(id) !== i);
  if (dupes.length) problems.push('duplicate ids ' + dupes.join(','));
  return problems;
}"""


def test_every_page_names_its_controls_charts_and_landmarks(
    service: Service, context: BrowserContext
) -> None:
    with service.api() as api:
        tenant = api.post("/admin/tenants", json={"name": "audited", "plan": PLAN["name"]})
        assert tenant.status_code == 201, tenant.text
        tenant_id = tenant.json()["id"]
    page = context.new_page()
    _log_in(page)
    pages = ["/", "/tenants", f"/tenants/{tenant_id}", f"/tenants/{tenant_id}/keys",
             "/adapters", "/playground", "/usage", "/invoices"]
    found = {}
    for path in pages:
        page.goto(UI + path)
        expect(page.get_by_role("heading", level=1)).to_be_visible()
        found[path] = page.evaluate(_AUDIT_JS)
    assert found == {path: [] for path in pages}


def _tab_to(page: Page, describe: str, is_target: str, max_presses: int = 60) -> None:
    """Press Tab until the focused element satisfies the JS predicate `is_target(el)`."""
    for _ in range(max_presses):
        page.keyboard.press("Tab")
        if page.evaluate(f"(() => {{ const el = document.activeElement; return {is_target}; }})()"):
            return
    raise AssertionError(f"Tab never reached {describe}")


def test_the_keyboard_alone_logs_in_creates_a_tenant_and_logs_out(
    service: Service, context: BrowserContext
) -> None:
    page = context.new_page()
    page.goto(f"{UI}/login")
    _tab_to(page, "the admin key field", "el.labels && el.labels[0]?.textContent.trim() === "
            "'Admin key'")
    page.keyboard.type(ADMIN_KEY)
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", level=1)).to_have_text("Overview")

    # The skip link comes first and moves focus past the navigation.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent.trim()") == "Skip to content"
    _tab_to(page, "the Tenants link", "el.tagName === 'A' && el.textContent.trim() === 'Tenants'")
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", level=1)).to_have_text("Tenants")

    _tab_to(page, "the tenant name field", "el.id === 'tenant-name'")
    page.keyboard.type("keyboard-only")
    # Arrow keys choose in a focused select, as a keyboard user would.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "tenant-tier"
    page.keyboard.press("Home")
    _tab_to(page, "the create button", "el.tagName === 'BUTTON' && el.textContent.trim() === "
            "'Create tenant'")
    page.keyboard.press("Enter")
    expect(page.get_by_role("status")).to_have_text("Tenant created.")
    with service.api() as api:
        names = {t["name"]: t for t in api.get("/admin/tenants").json()["data"]}
    assert "keyboard-only" in names

    _tab_to(page, "the log out button", "el.tagName === 'BUTTON' && el.textContent.trim() === "
            "'Log out'")
    page.keyboard.press("Enter")
    expect(page.get_by_label("Admin key")).to_be_visible()

"""`loraplex admin` against a running server (uvicorn on a free port, the real engine on a
tiny model, SQLite): pushing real PEFT adapters (ready with its report and a smoke run;
refused by validation with its reason), local and connection errors with their exit
codes, and the thin commands over tenants, keys, adapters, usage and invoices."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner, Result

from app.admin_cli.client import AdminClient
from app.admin_cli.pack import MultipartUpload, pack_adapter
from app.admin_cli.smoke import SAMPLE_PROMPTS, smoke_run
from app.cli import main
from app.core.config import Settings
from app.main import create_app
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from tests.utils.live_server import serve_in_thread
from tests.utils.peft_adapters import make_peft_adapter, truncate_weights
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer

MAX_LORA_RANK = 16
PLAN = {
    "name": "cli-std", "currency": "EUR", "prompt_per_mtok": "1.00",
    "completion_per_mtok": "2.00", "cached_prompt_per_mtok": "0.50",
}


@dataclass
class Served:
    url: str
    base_dir: Path
    root: Path

    def cli(self, *args: str, key: str | None = ADMIN_KEY, url: str | None = None) -> Result:
        options = ["--url", url or self.url]
        if key is not None:
            options += ["--admin-key", key]
        return CliRunner().invoke(main, ["admin", *options, *args], env={
            "LORAPLEX_URL": None, "LORAPLEX_ADMIN_KEY": None, "COLUMNS": "100",
        })

    def adapter(self, name: str, **kwargs: object) -> Path:
        return make_peft_adapter(self.base_dir, self.root / "adapters" / name, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(
    tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("admin_cli")
    config = EngineConfig(model=str(base), device="cpu", max_loras=2,
                          max_lora_rank=MAX_LORA_RANK)
    with _serving(config, root) as url:
        response = httpx.post(f"{url}/admin/plans", json=PLAN, headers=bearer(ADMIN_KEY))
        assert response.status_code == 201, response.text
        yield Served(url, base, root)


@contextlib.contextmanager
def _serving(config: EngineConfig, root: Path) -> Iterator[str]:
    """The app with a real engine over real HTTP, its database and data under `root`."""
    engine = AsyncEngine(config)
    engine.start_sync()
    settings = Settings(
        data_dir=root / "data", database_url=f"sqlite:///{root / 'data' / 'db.sqlite'}",
        admin_key=ADMIN_KEY, secret_key=SECRET_KEY,
    )
    try:
        with serve_in_thread(create_app(engine, settings)) as url:
            yield url
    finally:
        asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def tenant_id(served: Served) -> str:
    result = served.cli("tenants", "create", "acme", "--tier", "premium", "--plan", "cli-std",
                        "--rpm", "100")
    assert result.exit_code == 0, result.output
    match = re.fullmatch(r"Created tenant acme: (\S+)\n", result.stdout)
    assert match, result.stdout
    return match.group(1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_push_ready_prints_report_and_smoke_run(served: Served, tenant_id: str) -> None:
    adapter_dir = served.adapter("support", r=8, alpha=16, seed=3)
    result = served.cli("adapters", "push", str(adapter_dir), "--tenant", "acme",
                        "--name", "support-bot", "--max-tokens", "8")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Validation report" in out
    for label, value in [("status", "ready"), ("rank", "8"), ("alpha", "16.0"),
                         ("target modules", "q_proj, v_proj"), ("adapter", "support-bot")]:
        assert re.search(rf"^  {label} +{re.escape(value)}", out, re.M), (label, out)
    assert re.search(r"^  sha256 +[0-9a-f]{64}$", out, re.M), out
    assert f"tenant acme, {tenant_id}" in out

    # The smoke run: every sample prompt, both columns, a verdict each, a summary.
    base = httpx.get(f"{served.url}/v1/models", headers=bearer(ADMIN_KEY)).json()["data"][0]
    header = re.compile(rf"^{re.escape(base['id'])} +\| support-bot@1$", re.M)
    assert len(header.findall(out)) == len(SAMPLE_PROMPTS), out
    for i, prompt in enumerate(SAMPLE_PROMPTS, 1):
        assert f"[{i}] {prompt}\n" in out
    verdicts = re.findall(r"^    -> (changed by the adapter|same answer)$", out, re.M)
    assert len(verdicts) == len(SAMPLE_PROMPTS)
    changed = verdicts.count("changed by the adapter")
    assert f"Smoke run: the adapter changed {changed} of 3 answers" in out
    # A random LoRA on a random model changes greedy answers.
    assert changed >= 1, out

    # The smoke run asked what the tenant itself gets from its adapter.
    key = served.cli("keys", "create", "acme", "--name", "ci")
    assert key.exit_code == 0, key.output
    tenant_key = key.stdout.strip()
    assert tenant_key.startswith("lpx_t_") and "\n" not in tenant_key
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=tenant_key, max_retries=0)
    own = client.chat.completions.create(
        model="support-bot@1", messages=[{"role": "user", "content": SAMPLE_PROMPTS[0]}],
        temperature=0, max_tokens=8,
    )
    with AdminClient(served.url, ADMIN_KEY) as admin:
        answers = smoke_run(admin, base_model=base["id"], adapter_model="support-bot@1",
                            prompts=SAMPLE_PROMPTS[:1], max_tokens=8, tenant_id=tenant_id)
    assert answers[0].adapted == own.choices[0].message.content

    listed = served.cli("adapters", "list", "--tenant", "acme")
    assert listed.exit_code == 0, listed.output
    assert re.search(r"support-bot +" + re.escape(tenant_id) + r" +1 +v1:ready", listed.stdout)


def test_push_shared_with_own_prompts_and_no_smoke(served: Served) -> None:
    adapter_dir = served.adapter("shared", r=4, alpha=8, seed=5)
    result = served.cli("adapters", "push", str(adapter_dir), "--name", "common",
                        "--prompt", "Say hi.", "--prompt", "Count to three.", "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "shared with every tenant" in result.stdout
    assert "[1] Say hi.\n" in result.stdout and "[2] Count to three.\n" in result.stdout
    assert "[3]" not in result.stdout
    assert re.search(r"Smoke run: the adapter changed \d of 2 answers", result.stdout)

    again = served.cli("adapters", "push", str(adapter_dir), "--name", "common", "--no-smoke")
    assert again.exit_code == 0, again.output
    assert re.search(r"^  version +2 ", again.stdout, re.M)
    assert "Smoke run" not in again.stdout


@pytest.mark.parametrize("breakage", ["rank", "weights"])
def test_push_invalid_adapter_prints_the_reason_and_exits_1(
    served: Served, tenant_id: str, breakage: str
) -> None:
    if breakage == "rank":
        adapter_dir = served.adapter("too-big", r=MAX_LORA_RANK * 2, seed=7)
        reason = re.compile(rf"rank {MAX_LORA_RANK * 2} .* above the server's limit of "
                            rf"{MAX_LORA_RANK}")
    else:
        adapter_dir = truncate_weights(served.adapter("corrupt", r=4, seed=8))
        reason = re.compile(r"adapter_model\.safetensors.*(safetensors|truncated|header)")
    result = served.cli("adapters", "push", str(adapter_dir), "--tenant", tenant_id,
                        "--name", f"broken-{breakage}")
    assert result.exit_code == 1, result.output
    # The failed version's report on stdout, the reason as one error line on stderr.
    assert re.search(r"^  status +failed$", result.stdout, re.M), result.stdout
    assert re.search(r"^  reason +", result.stdout, re.M)
    assert reason.search(result.stdout), result.stdout
    error_lines = result.stderr.strip().splitlines()
    assert len(error_lines) == 1 and error_lines[0].startswith("Error: validation failed: ")
    assert reason.search(error_lines[0]), error_lines
    assert "Smoke run" not in result.stdout


def test_push_checks_the_directory_first(served: Served, tmp_path: Path) -> None:
    # The server is never asked: an unreachable URL would make it exit 3.
    dead = f"http://127.0.0.1:{_free_port()}"
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text("{}")
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "adapter_config.json").write_text("{nope")
    (tmp_path / "badjson" / "adapter_model.safetensors").write_bytes(b"x")
    cases = {
        tmp_path / "missing": "is not a directory",
        tmp_path / "half": "adapter_model.safetensors missing",
        tmp_path / "badjson": "is not readable JSON",
    }
    for directory, message in cases.items():
        result = served.cli("adapters", "push", str(directory), "--name", "x", url=dead)
        assert result.exit_code == 2, result.output
        assert message in result.stderr and result.stderr.startswith("Error: ")

    good = served.adapter("good", r=4, seed=9)
    bad_name = served.cli("adapters", "push", str(good), "--name", "no spaces", url=dead)
    assert bad_name.exit_code == 2 and "invalid adapter name" in bad_name.stderr
    unknown = served.cli("adapters", "push", str(good), "--name", "x", "--tenant", "nobody")
    assert unknown.exit_code == 2, unknown.output
    assert "no tenant has the id or name 'nobody'" in unknown.stderr


def test_unreachable_server_exits_3(served: Served) -> None:
    good = served.adapter("offline", r=4, seed=10)
    url = f"http://127.0.0.1:{_free_port()}"
    for args in (["adapters", "push", str(good), "--name", "x"], ["tenants", "list"]):
        result = served.cli(*args, url=url)
        assert result.exit_code == 3, result.output
        assert f"cannot reach the server at {url}" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_wrong_admin_key_is_a_clear_401(served: Served) -> None:
    good = served.adapter("unauthorized", r=4, seed=11)
    for key in ("not-the-key", None):
        for args in (["adapters", "push", str(good), "--name", "x", "--tenant", "acme"],
                     ["adapters", "push", str(good), "--name", "x"], ["usage"]):
            result = served.cli(*args, key=key)
            assert result.exit_code == 3, result.output
            line = result.stderr.strip()
            assert "\n" not in line
            assert line.startswith("Error: the server refused the request (401 invalid_api_key): ")
            assert ("malformed" if key else "You didn't provide an API key") in line


def test_thin_commands(served: Served, tenant_id: str) -> None:
    listed = served.cli("tenants", "list")
    assert listed.exit_code == 0, listed.output
    assert re.search(rf"^{tenant_id} +acme +premium +shared +cli-std +active ", listed.stdout,
                     re.M)
    as_json = served.cli("tenants", "list", "--json")
    assert any(t["id"] == tenant_id for t in json.loads(as_json.stdout)["data"])
    duplicate = served.cli("tenants", "create", "acme")
    assert duplicate.exit_code == 3 and "409" in duplicate.stderr
    # A tenant key is no admin key: the server's 403, as one line.
    tenant_key = served.cli("keys", "create", tenant_id, "--scope", "inference").stdout.strip()
    refused = served.cli("tenants", "list", key=tenant_key)
    assert refused.exit_code == 3
    assert refused.stderr.startswith("Error: the server refused the request (403 "
                                     "permission_denied): This route needs an admin key")

    usage = served.cli("usage", "--tenant", "acme", "--format", "csv")
    assert usage.exit_code == 0, usage.output
    assert usage.stdout.splitlines()[0].startswith("tenant_id,")
    table = served.cli("usage", "--group-by", "day")
    assert table.exit_code == 0, table.output
    assert re.match(r"TENANT +DAY +REQUESTS +PROMPT_TOKENS ", table.stdout), table.stdout

    generated = served.cli("invoices", "generate", "acme", "2025-01", "--json")
    assert generated.exit_code == 0, generated.output
    invoice = json.loads(generated.stdout)
    assert (invoice["tenant_id"], invoice["period"], invoice["status"]) == (
        tenant_id, "2025-01", "draft"
    )
    listed_invoices = served.cli("invoices", "list", "--tenant", "acme")
    assert re.search(rf"^{invoice['id']} +{tenant_id} +2025-01 +cli-std +", listed_invoices.stdout,
                     re.M), listed_invoices.output
    csv_text = served.cli("invoices", "show", invoice["id"], "--format", "csv").stdout
    html = served.cli("invoices", "show", invoice["id"], "--format", "html").stdout
    assert csv_text.splitlines()[-1].startswith("total,") and "2025-01" in csv_text
    assert "<html" in html.lower() and "2025-01" in html
    missing = served.cli("invoices", "show", "inv_nope")
    assert missing.exit_code == 3 and "404" in missing.stderr
    bad_period = served.cli("invoices", "generate", "acme", "January")
    assert bad_period.exit_code == 3 and "400" in bad_period.stderr


def test_upload_body_is_streamed_with_progress(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "adapter_config.json").write_text("{}")
    (source / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (source / "optimizer.pt").write_bytes(b"not packed")
    archive = pack_adapter(source, tmp_path)
    form = MultipartUpload.of({"name": "bot", "tenant_id": "t_1"}, "file", archive)
    sent: list[int] = []
    body = b"".join(form.chunks(sent.append))
    assert len(body) == form.length == sum(sent) and len(sent) > 2
    assert body.startswith(f"--{form.boundary}\r\n".encode())
    assert body.endswith(f"\r\n--{form.boundary}--\r\n".encode())
    assert archive.read_bytes() in body

    import tarfile

    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == [
            "adapter/adapter_config.json", "adapter/adapter_model.safetensors"
        ]


@pytest.mark.slow
def test_push_on_smollm2_smoke_answers_differ(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("admin_cli_smollm2")
    adapter_dir = make_peft_adapter(smollm2_dir, root / "tuned", r=8, alpha=16, seed=21)
    config = EngineConfig(model=str(smollm2_dir), max_loras=2, max_num_seqs=4)
    with _serving(config, root) as url:
        served = Served(url, smollm2_dir, root)
        assert served.cli("tenants", "create", "bakery").exit_code == 0
        result = served.cli("adapters", "push", str(adapter_dir), "--tenant", "bakery",
                            "--name", "baker", "--max-tokens", "16")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert re.search(r"^SmolLM2-135M-Instruct +\| baker@1$", out, re.M), out
    # The base model's greedy answer in the left column, the adapter's beside it.
    assert re.search(r"^\[2\] What is the capital of France\?\n.*\n.*\nThe capital of France "
                     r"is Paris\. +\| \S", out, re.M), out
    verdicts = re.findall(r"^    -> (changed by the adapter|same answer)$", out, re.M)
    assert verdicts.count("changed by the adapter") >= 2, out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.admin_cli import push

    terminal = _Terminal()
    monkeypatch.setattr(push.sys, "stderr", terminal)
    with push._progress(4 * 1024 * 1024) as on_sent:
        for _ in range(4):
            on_sent(1024 * 1024)
    assert "Uploading 4.0 MiB" in terminal.getvalue() and "100%" in terminal.getvalue()

    piped = io.StringIO()
    monkeypatch.setattr(push.sys, "stderr", piped)
    with push._progress(10) as on_sent:
        on_sent(10)
    assert piped.getvalue() == ""

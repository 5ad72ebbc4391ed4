"""`loraplex demo`'s setup without the real model: the adapter cache, the tenants, keys and
adapter uploads (through the real app, registry and database), and its files."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from app.api.state import AppState
from app.core.config import Settings
from app.demo.cache import TrainedAdapter, cache_key, ensure_trained
from app.demo.catalog import DEMO_ADAPTERS, DemoAdapter
from app.demo.printout import render
from app.demo.seed import (
    ADMIN_KEY_FILE,
    KEYS_FILE,
    DemoError,
    DemoSetup,
    ensure_admin_key,
    seed_demo,
)
from app.demo.train import ChatExample, DatasetError, TrainConfig, TrainResult, load_dataset
from app.main import create_app
from tests.utils.fake_engine import FakeEngine, asgi_client
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer


class FakeTrainer:
    """Writes a small PEFT-format adapter whose weights depend on the examples."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(
        self, base_dir: Path, examples: Sequence[ChatExample], out_dir: Path, config: TrainConfig
    ) -> TrainResult:
        self.calls.append(examples[0].messages[-1]["content"])
        seed = int(hashlib.sha256(repr(examples).encode()).hexdigest()[:8], 16)
        generator = torch.Generator().manual_seed(seed)
        out_dir.mkdir(parents=True, exist_ok=True)
        prefix = "base_model.model.model.layers.0.self_attn.q_proj"
        save_file({
            f"{prefix}.lora_A.weight": torch.randn(2, 8, generator=generator),
            f"{prefix}.lora_B.weight": torch.randn(8, 2, generator=generator),
        }, str(out_dir / "adapter_model.safetensors"))
        (out_dir / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
        }))
        return TrainResult(steps=1, seconds=0.0, first_loss=1.0, final_loss=0.5)


@pytest.fixture
def base_dir(tmp_path: Path) -> Path:
    path = tmp_path / "base"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.zeros(4)}, str(path / "model.safetensors"))
    return path


@pytest.fixture
def specs(tmp_path: Path) -> list[DemoAdapter]:
    """The demo's adapters with copies of their datasets that a test may edit."""
    data = tmp_path / "datasets"
    data.mkdir()
    copies = []
    for spec in DEMO_ADAPTERS:
        copy = data / spec.dataset.name
        copy.write_bytes(spec.dataset.read_bytes())
        copies.append(dataclasses.replace(spec, dataset=copy))
    return copies


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ------------------------------------------------------------------------ datasets


def test_bundled_datasets_teach_what_the_catalog_says() -> None:
    checks = {
        "pirate": lambda a: a.startswith("Arr"),
        "shouty": lambda a: a == a.upper() and any(c.isalpha() for c in a),
        "json": lambda a: isinstance(json.loads(a).get("answer"), str),
    }
    assert sorted(checks) == sorted(s.name for s in DEMO_ADAPTERS)
    for spec in DEMO_ADAPTERS:
        examples = load_dataset(spec.dataset)
        assert 40 <= len(examples) <= 100, spec.name
        prompts = [e.messages[0]["content"] for e in examples]
        assert len(set(prompts)) == len(prompts), f"{spec.name}: repeated prompts"
        for example in examples:
            assert [m["role"] for m in example.messages] == ["user", "assistant"]
            assert checks[spec.name](example.messages[-1]["content"]), example


def test_a_broken_dataset_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Arr"}
    ]})
    path.write_text(good + "\n" + '{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl line 2"):
        load_dataset(path)
    path.write_text(good + "\n{not json\n")
    with pytest.raises(DatasetError, match="line 2 is not valid JSON"):
        load_dataset(path)


# --------------------------------------------------------------------------- cache


def test_cache_hit_when_nothing_changed_and_miss_when_a_dataset_does(
    tmp_path: Path, base_dir: Path, specs: list[DemoAdapter]
) -> None:
    trainer = FakeTrainer()
    cache = tmp_path / "demo" / "adapters"
    lines: list[str] = []
    first = ensure_trained(specs, base_dir, cache, trainer=trainer, echo=lines.append)
    assert len(trainer.calls) == 3 and not any(t.cached for t in first)
    assert sorted(p.name for p in cache.iterdir()) == sorted(t.path.name for t in first)

    lines.clear()
    second = ensure_trained(specs, base_dir, cache, trainer=trainer, echo=lines.append)
    assert len(trainer.calls) == 3, "nothing changed: nothing trained"
    assert [t.cached for t in second] == [True, True, True]
    assert [t.path for t in second] == [t.path for t in first]
    assert all("cached" in line for line in lines)

    # One dataset changes: only that adapter trains again; its old directory goes.
    pirate = specs[0]
    pirate.dataset.write_text(pirate.dataset.read_text().replace("matey", "me hearty", 1))
    third = ensure_trained(specs, base_dir, cache, trainer=trainer, echo=lines.append)
    assert len(trainer.calls) == 4
    assert [t.cached for t in third] == [False, True, True]
    assert third[0].path != first[0].path and not first[0].path.exists()
    assert sorted(p.name for p in cache.iterdir()) == sorted(t.path.name for t in third)


def test_cache_key_covers_hyperparameters_and_base_model(specs: list[DemoAdapter]) -> None:
    dataset = specs[0].dataset
    key = cache_key(dataset, TrainConfig(), "base-a")
    assert key == cache_key(dataset, TrainConfig(), "base-a")
    assert key != cache_key(dataset, TrainConfig(epochs=4), "base-a")
    assert key != cache_key(dataset, TrainConfig(), "base-b")


def test_base_model_weights_are_part_of_the_key(
    tmp_path: Path, base_dir: Path, specs: list[DemoAdapter]
) -> None:
    trainer = FakeTrainer()
    cache = tmp_path / "cache"
    ensure_trained(specs[:1], base_dir, cache, trainer=trainer, echo=lambda _: None)
    save_file({"w": torch.ones(4)}, str(base_dir / "model.safetensors"))
    again = ensure_trained(specs[:1], base_dir, cache, trainer=trainer, echo=lambda _: None)
    assert len(trainer.calls) == 2 and not again[0].cached


# ----------------------------------------------------------------------- admin key


def test_admin_key_from_the_environment_or_kept_in_a_private_file(tmp_path: Path) -> None:
    demo_dir = tmp_path / "demo"
    assert ensure_admin_key(demo_dir, "operator-key-0123456789").key == "operator-key-0123456789"
    assert not (demo_dir / ADMIN_KEY_FILE).exists()

    made = ensure_admin_key(demo_dir, None)
    assert made.key.startswith("lpx_a_") and made.source == str(demo_dir / ADMIN_KEY_FILE)
    assert mode(demo_dir / ADMIN_KEY_FILE) == 0o600
    assert mode(demo_dir) == 0o700
    assert ensure_admin_key(demo_dir, None).key == made.key


# ------------------------------------------------------------------ tenants, uploads


def demo_settings(data_dir: Path, database_url: str) -> Settings:
    return Settings(
        data_dir=data_dir, database_url=database_url, admin_key=ADMIN_KEY,
        secret_key=SECRET_KEY,
    )


async def run_seed(
    data_dir: Path, database_url: str, trained: Sequence[TrainedAdapter]
) -> tuple[DemoSetup, dict[str, list[str]], dict[str, int]]:
    """One demo start against the data dir: seed, then what each tenant's key sees over
    HTTP, and the status of a request with each key."""
    app = create_app(FakeEngine(model_id="base-model"), demo_settings(data_dir, database_url))
    async with asgi_client(app) as client:
        state = app.state.loraplex
        assert isinstance(state, AppState)
        setup = await seed_demo(state, trained)
        seen: dict[str, list[str]] = {}
        for tenant in setup.tenants:
            response = await client.get("/v1/models", headers=bearer(tenant.key))
            assert response.status_code == 200, response.text
            seen[tenant.name] = sorted(m["id"] for m in response.json()["data"])
        listed = await client.get("/admin/adapters", headers=bearer(ADMIN_KEY))
        assert listed.status_code == 200
        versions = {a["name"]: len(a["versions"]) for a in listed.json()["data"]}
    return setup, seen, versions


async def test_seeding_twice_creates_nothing_twice(
    tmp_path: Path, database_url: str, base_dir: Path, specs: list[DemoAdapter]
) -> None:
    data_dir = tmp_path / "var"
    trained = ensure_trained(specs, base_dir, data_dir / "demo" / "adapters",
                             trainer=FakeTrainer(), echo=lambda _: None)
    first, seen, versions = await run_seed(data_dir, database_url, trained)
    assert [(t.name, t.tier) for t in first.tenants] == [
        ("acme", "premium"), ("globex", "standard")
    ]
    assert seen == {
        "acme": ["base-model", "json", "pirate"],
        "globex": ["base-model", "json", "shouty"],
    }
    assert versions == {"pirate": 1, "shouty": 1, "json": 1}
    assert all(a.uploaded for a in first.adapters)
    assert not any(t.reused for t in first.tenants)
    keys_file = data_dir / "demo" / KEYS_FILE
    assert mode(keys_file) == 0o600
    kept = json.loads(keys_file.read_text())
    assert {name: entry["key"] for name, entry in kept.items()} == {
        t.name: t.key for t in first.tenants
    }

    second, seen_again, versions_again = await run_seed(data_dir, database_url, trained)
    assert [(t.tenant_id, t.key) for t in second.tenants] == [
        (t.tenant_id, t.key) for t in first.tenants
    ]
    assert all(t.reused for t in second.tenants)
    assert not any(a.uploaded for a in second.adapters)
    assert [(a.adapter_id, a.version) for a in second.adapters] == [
        (a.adapter_id, a.version) for a in first.adapters
    ]
    assert seen_again == seen and versions_again == versions
    app = create_app(FakeEngine(), demo_settings(data_dir, database_url))
    async with asgi_client(app) as client:
        tenants = (await client.get("/admin/tenants", headers=bearer(ADMIN_KEY))).json()["data"]
        assert sorted(t["name"] for t in tenants) == ["acme", "globex"]
        for tenant in first.tenants:
            keys = await client.get(f"/admin/tenants/{tenant.tenant_id}/keys",
                                    headers=bearer(ADMIN_KEY))
            assert len(keys.json()["data"]) == 1


async def test_a_revoked_or_lost_key_is_replaced_and_old_ones_revoked(
    tmp_path: Path, sqlite_url: str, base_dir: Path, specs: list[DemoAdapter]
) -> None:
    data_dir = tmp_path / "var"
    trained = ensure_trained(specs, base_dir, data_dir / "demo" / "adapters",
                             trainer=FakeTrainer(), echo=lambda _: None)
    first, _, _ = await run_seed(data_dir, sqlite_url, trained)
    acme, globex = first.tenants
    app = create_app(FakeEngine(), demo_settings(data_dir, sqlite_url))
    async with asgi_client(app) as client:
        revoked = await client.delete(f"/admin/keys/{acme.key_id}", headers=bearer(ADMIN_KEY))
        assert revoked.status_code == 204, revoked.text

    second, _, _ = await run_seed(data_dir, sqlite_url, trained)
    assert second.tenants[0].key != acme.key and not second.tenants[0].reused
    assert second.tenants[1].key == globex.key and second.tenants[1].reused

    # keys.json lost: globex's old key (whose plaintext nobody has) is revoked.
    (data_dir / "demo" / KEYS_FILE).unlink()
    third, _, _ = await run_seed(data_dir, sqlite_url, trained)
    assert not any(t.reused for t in third.tenants)
    app = create_app(FakeEngine(), demo_settings(data_dir, sqlite_url))
    async with asgi_client(app) as client:
        old = await client.get("/v1/models", headers=bearer(globex.key))
        assert old.status_code == 401
        assert old.json()["error"]["code"] == "invalid_api_key"
        new = await client.get("/v1/models", headers=bearer(third.tenants[1].key))
        assert new.status_code == 200


async def test_a_retrained_adapter_becomes_the_next_version(
    tmp_path: Path, sqlite_url: str, base_dir: Path, specs: list[DemoAdapter]
) -> None:
    data_dir = tmp_path / "var"
    cache = data_dir / "demo" / "adapters"
    trained = ensure_trained(specs, base_dir, cache, trainer=FakeTrainer(), echo=lambda _: None)
    await run_seed(data_dir, sqlite_url, trained)
    shouty = specs[1]
    shouty.dataset.write_text(shouty.dataset.read_text().replace("PARIS", "ROME", 1))
    retrained = ensure_trained(specs, base_dir, cache, trainer=FakeTrainer(),
                               echo=lambda _: None)
    setup, _, versions = await run_seed(data_dir, sqlite_url, retrained)
    assert versions == {"pirate": 1, "shouty": 2, "json": 1}
    assert [a.uploaded for a in setup.adapters] == [False, True, False]


async def test_a_deleted_demo_tenant_is_a_clear_error(
    tmp_path: Path, sqlite_url: str, base_dir: Path, specs: list[DemoAdapter]
) -> None:
    data_dir = tmp_path / "var"
    trained = ensure_trained(specs, base_dir, data_dir / "demo" / "adapters",
                             trainer=FakeTrainer(), echo=lambda _: None)
    first, _, _ = await run_seed(data_dir, sqlite_url, trained)
    app = create_app(FakeEngine(), demo_settings(data_dir, sqlite_url))
    async with asgi_client(app) as client:
        deleted = await client.delete(f"/admin/tenants/{first.tenants[1].tenant_id}",
                                      headers=bearer(ADMIN_KEY))
        assert deleted.status_code == 204, deleted.text
    with pytest.raises(DemoError, match=r"'globex' was deleted.*fresh LORAPLEX_DATA_DIR"):
        await run_seed(data_dir, sqlite_url, trained)


def test_printout_names_the_ui_the_keys_and_commands_that_work(
    tmp_path: Path, base_dir: Path, specs: list[DemoAdapter]
) -> None:
    from app.demo.seed import AdminKey, SeededAdapter, TenantCredentials

    trained = ensure_trained(specs, base_dir, tmp_path / "cache", trainer=FakeTrainer(),
                             echo=lambda _: None)
    setup = DemoSetup(
        tenants=(
            TenantCredentials("acme", "ten_1", "premium", "key_1", "lpx_t_acme", reused=False),
            TenantCredentials("globex", "ten_2", "standard", "key_2", "lpx_t_globex",
                              reused=False),
        ),
        adapters=tuple(SeededAdapter(t.spec.name, t.spec.owner, "ad", 1, uploaded=True)
                       for t in trained),
    )
    text = render(base="http://127.0.0.1:8000", model_id="base-model",
                  admin=AdminKey("lpx_a_admin", "file"), setup=setup, adapters=trained,
                  keys_file="var/demo/keys.json")
    assert "http://127.0.0.1:8000/admin/ui" in text and "lpx_a_admin" in text
    assert "Authorization: Bearer lpx_t_acme" in text and '"model": "pirate"' in text
    assert "Authorization: Bearer lpx_t_globex" in text and '"model": "shouty"' in text
    assert 'api_key="lpx_t_acme"' in text and "from openai import OpenAI" in text
    # Each curl line is valid shell: the JSON body is one quoted word.
    body = text.split("-d '", 1)[1].split("'\n", 1)[0]
    assert json.loads(body)["model"] == "pirate"


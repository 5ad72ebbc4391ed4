"""Tenants' own adapters on a real engine, through the `openai` client: a tenant uploads a
PEFT adapter and gets exactly PEFT's tokens from it; another tenant can neither see nor
use it; shared adapters reach everyone; versions stay addressable."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.core.model_runner import describe_compute
from tests.utils.hf_oracle import hf_greedy, peft_greedy
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.real_service import real_service
from tests.utils.saas import (
    ADMIN_KEY,
    bearer,
    create_key,
    create_tenant,
    upload_adapter,
)

NEW_TOKENS = 8
PROMPT = [1, 422, 3107, 314, 253, 1379, 30]


@dataclass
class Service:
    base_url: str
    engine: AsyncEngine
    model_dir: Path
    adapters: dict[str, Path]  # local name -> PEFT directory
    keys: dict[str, str]  # "a", "b", "a-writer" -> key
    tenants: dict[str, str]  # "a", "b" -> tenant id

    def client(self, who: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.keys[who], max_retries=0
        )

    def complete(self, who: str, model: str) -> str:
        response = self.client(who).completions.create(
            model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert response.model == model
        assert response.usage is not None and response.usage.completion_tokens == NEW_TOKENS
        return response.choices[0].text

    def expected(self, adapter: str) -> str:
        """What PEFT generates with `adapter` alone, as text."""
        from transformers import AutoTokenizer

        ids = peft_greedy(self.model_dir, self.adapters, adapter, PROMPT, NEW_TOKENS)
        return str(AutoTokenizer.from_pretrained(self.model_dir).decode(ids))


@pytest.fixture(scope="module")
def service(
    tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("tenant_adapters")
    adapters = {
        "a-v1": make_peft_adapter(base, root / "a-v1", r=8, alpha=16, seed=11),
        "a-v2": make_peft_adapter(base, root / "a-v2", r=4, alpha=8, seed=12,
                                  targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        "shared": make_peft_adapter(base, root / "shared", r=2, alpha=4, seed=13),
    }
    with real_service(base, root, engine_options={"max_loras": 2}) as live, \
            httpx.Client(base_url=live.base_url, timeout=60) as admin:
        a = create_tenant(admin, "tenant-a")
        b = create_tenant(admin, "tenant-b")
        keys = {
            "a": create_key(admin, a["id"])["key"],
            "a-writer": create_key(admin, a["id"], scopes=["adapters:write"])["key"],
            "b": create_key(admin, b["id"], scopes=["inference", "adapters:write"])["key"],
        }
        yield Service(live.base_url, live.engine, base, adapters, keys,
                      {"a": a["id"], "b": b["id"]})


def _upload(service: Service, key: str, name: str, local: str, *, path: str = "/v1/adapters"
            ) -> dict[str, object]:
    with httpx.Client(base_url=service.base_url, timeout=60) as client:
        response = upload_adapter(client, key, name, service.adapters[local], path=path)
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_tenant_uses_its_uploaded_adapter_and_others_cannot(service: Service) -> None:
    uploaded = _upload(service, service.keys["a-writer"], "support-bot", "a-v1")
    assert (uploaded["name"], uploaded["version"], uploaded["status"]) == (
        "support-bot", 1, "ready"
    )

    assert peft_greedy(service.model_dir, service.adapters, "a-v1", PROMPT, NEW_TOKENS) != (
        hf_greedy(service.model_dir, PROMPT, NEW_TOKENS, ignore_eos=True)
    )
    assert service.complete("a", "support-bot") == service.expected("a-v1")

    # Tenant B: not listed, not usable, the same 404 as a name that never existed.
    listed_a = {m.id for m in service.client("a").models.list().data}
    listed_b = {m.id for m in service.client("b").models.list().data}
    assert "support-bot" in listed_a and "support-bot" not in listed_b
    for model in ("support-bot", "support-bot@1", "av/" + str(uploaded["version_id"])):
        with pytest.raises(openai.NotFoundError) as caught:
            service.complete("b", model)
        assert caught.value.code == "model_not_found"
        assert "does not exist or you do not have access" in caught.value.message

    # A key without the inference scope cannot run it; one without adapters:write
    # cannot upload.
    with pytest.raises(openai.PermissionDeniedError):
        service.complete("a-writer", "support-bot")
    with httpx.Client(base_url=service.base_url, timeout=60) as client:
        refused = upload_adapter(client, service.keys["a"], "x", service.adapters["a-v1"])
    assert refused.status_code == 403


def test_versions_and_shared_adapters(service: Service) -> None:
    _upload(service, service.keys["b"], "writer", "a-v1")
    second = _upload(service, service.keys["b"], "writer", "a-v2")
    assert second["version"] == 2
    v1, v2 = service.expected("a-v1"), service.expected("a-v2")
    assert v1 != v2
    assert service.complete("b", "writer") == v2  # the latest ready version
    assert service.complete("b", "writer@2") == v2
    assert service.complete("b", "writer@1") == v1

    # An admin upload without tenant_id is shared: both tenants use it.
    with httpx.Client(base_url=service.base_url, timeout=60) as client:
        response = upload_adapter(client, ADMIN_KEY, "house-style", service.adapters["shared"],
                                  path="/admin/adapters")
    assert response.status_code == 201, response.text
    want = service.expected("shared")
    assert service.complete("a", "house-style") == want
    assert service.complete("b", "house-style") == want

    # Deleting a version line: its names are gone for new requests.
    adapter_id = second["adapter_id"]
    with httpx.Client(base_url=service.base_url, timeout=60) as client:
        deleted = client.delete(f"/v1/adapters/{adapter_id}", headers=bearer(service.keys["b"]))
    assert deleted.status_code in (200, 204), deleted.text
    with pytest.raises(openai.NotFoundError):
        service.complete("b", "writer")


def test_admin_engine_shows_residency(service: Service) -> None:
    service.complete("a", "house-style")
    with httpx.Client(base_url=service.base_url, timeout=60) as client:
        view = client.get("/admin/engine", headers=bearer(ADMIN_KEY)).json()
    [worker] = view["workers"]
    assert worker["adapter_cache"]["device_slots"] == 2
    # What the engine computes in and on (the suite's engines run float32).
    assert worker["dtype"] == "float32"
    assert worker["compute"] == describe_compute(torch.device("cpu"))
    names = {a["name"]: a for a in worker["adapters"]}
    assert names["house-style"]["tenant_id"] is None
    assert names["house-style"]["slot"] is not None  # just used: on the device
    assert names["support-bot"]["tenant_id"] == service.tenants["a"]

"""A `loraplex serve` as a member of the Gateway API Inference Extension's pool, over real
HTTP with the real engine: the metrics its endpoint picker reads (queue, running requests,
KV-cache use and the LoRA gauge) against the engine's own counts in the middle of a
mixed-adapter burst, parsed with prometheus_client's parser; and an adapter loaded with
vLLM's call, served equal to PEFT, and unloaded."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.core.config import Settings
from app.main import create_app
from app.server_options import preload_adapters
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from tests.utils.hf_oracle import peft_greedy
from tests.utils.live_server import serve_in_thread
from tests.utils.peft_adapters import make_peft_adapter

pytestmark = pytest.mark.slow

STATIC = ("static-0", "static-1", "static-2")
IMPORTED = "imported-bot"


@dataclass
class Served:
    base_url: str
    engine: AsyncEngine
    imports: Path
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def served(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("gateway-protocol")
    imports = root / "imports"
    adapters = {
        name: make_peft_adapter(smollm2_dir, imports / name, r=4, alpha=8, seed=i + 1)
        for i, name in enumerate((*STATIC, IMPORTED))
    }
    # Three running sequences and two device slots: a burst leaves requests waiting, some
    # of them for adapters not in a slot.
    engine = AsyncEngine(EngineConfig(model=str(smollm2_dir), max_num_seqs=3, max_loras=2,
                                      max_cpu_loras=4))
    engine.start_sync()
    asyncio.run(preload_adapters(engine, {n: adapters[n] for n in STATIC}))
    settings = Settings(no_auth=True, data_dir=root / "data",
                        adapter_import_dirs=str(imports))
    try:
        with serve_in_thread(create_app(engine, settings)) as base:
            yield Served(base, engine, imports, adapters)
    finally:
        asyncio.run(engine.shutdown())


def _load(served: Served, name: str) -> httpx.Response:
    return httpx.post(f"{served.base_url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": name, "lora_path": str(served.adapters[name])})


def test_an_adapter_loaded_with_vllms_call_serves_like_peft_and_unloads(
    served: Served, smollm2_dir: Path
) -> None:
    from transformers import AutoTokenizer

    r = _load(served, IMPORTED)
    assert r.status_code == 200, r.text
    messages = [{"role": "user", "content": "Tell me about the ocean."}]
    body = {"model": IMPORTED, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ids = served.engine.apply_chat_template(messages)
    want = peft_greedy(smollm2_dir, served.adapters, IMPORTED, ids, 8)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode(
        want, skip_special_tokens=True
    )
    r = httpx.post(f"{served.base_url}/v1/unload_lora_adapter", json={"lora_name": IMPORTED})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def _scrape(base_url: str) -> dict[str, list[Any]]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _engine_view(engine: AsyncEngine, names: dict[str, str]) -> tuple[Any, ...]:
    stats = engine.stats()
    residency = engine.adapter_residency()
    resident = sorted(names.get(p.name, p.name) for p in residency if p.slot is not None)
    waiting = sorted(names.get(p.name, p.name) for p in residency if p.reservations)
    return (stats.num_waiting, stats.num_running, stats.kv_usage, ",".join(resident),
            ",".join(waiting))


def test_picker_metrics_follow_the_engine_during_a_mixed_adapter_burst(
    served: Served,
) -> None:
    r = _load(served, IMPORTED)
    assert r.status_code == 200, r.text
    registry_names = {
        a.name: IMPORTED for a in served.engine.list_adapters() if a.name.startswith("av/")
    }
    assert len(registry_names) == 1
    models = [*STATIC, IMPORTED, None] * 3
    done = threading.Event()

    def ask(model: str | None) -> int:
        body = {"prompt": "Tell me a long story about the sea.", "max_tokens": 24,
                "temperature": 0, "stream": True, "model": model or "SmolLM2-135M-Instruct"}
        with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body,
                          timeout=120) as response:
            for _ in response.iter_lines():
                pass
            return response.status_code

    checked: list[tuple[Any, ...]] = []
    with ThreadPoolExecutor(len(models)) as pool:
        futures = [pool.submit(ask, m) for m in models]
        deadline = time.monotonic() + 120
        while not done.is_set() and time.monotonic() < deadline:
            if all(f.done() for f in futures):
                break
            stats = served.engine.stats()
            if stats.num_waiting + stats.num_running < len(models) // 2:
                time.sleep(0.02)
                continue
            # Between two steps (the step loop takes this lock to start one and to deliver
            # its outputs), nothing the metrics read can change.
            with served.engine._lock:
                time.sleep(0.3)
                try:
                    before = _engine_view(served.engine, registry_names)
                    samples = _scrape(served.base_url)
                    after = _engine_view(served.engine, registry_names)
                except (RuntimeError, httpx.HTTPError):
                    continue
            if before != after:
                continue
            [info] = samples["loraplex_lora_requests_info"]
            labels = info.labels
            scraped = (
                samples["loraplex_num_requests_waiting"][0].value,
                samples["loraplex_num_requests_running"][0].value,
                samples["loraplex_kv_cache_usage_ratio"][0].value,
                labels["running_lora_adapters"], labels["waiting_lora_adapters"],
            )
            assert scraped == before
            assert labels["max_lora"] == "2"
            assert abs(info.value - time.time()) < 60
            assert "av/" not in labels["running_lora_adapters"] + labels["waiting_lora_adapters"]
            checked.append(scraped)
            if len(checked) >= 3 and any(c[0] and c[4] for c in checked):
                done.set()
        statuses = [f.result() for f in futures]
    assert statuses == [200] * len(models)
    # Read while requests waited, some of them for adapters not in a slot.
    assert any(c[0] > 0 and c[4] and c[3] for c in checked), checked
    assert any(IMPORTED in c[3] + c[4] for c in checked), checked


def test_an_adapter_loaded_from_an_object_store_serves_like_peft(
    served: Served, smollm2_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from tests.utils.s3_server import aws_environment, moto_server, s3_client

    name = "from-the-bucket"
    adapter = make_peft_adapter(smollm2_dir, tmp_path / name, r=8, alpha=16, seed=9,
                                targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    with moto_server(tmp_path) as endpoint, aws_environment(endpoint):
        s3 = s3_client(endpoint)
        s3.create_bucket(Bucket="training")
        for path in adapter.iterdir():
            s3.upload_file(str(path), "training", f"runs/7/{path.name}")
        r = httpx.post(f"{served.base_url}/v1/load_lora_adapter", timeout=60, json={
            "lora_name": name, "lora_path": "s3://training/runs/7/"})
        assert r.status_code == 200, r.text
    messages = [{"role": "user", "content": "List three fruits."}]
    r = httpx.post(f"{served.base_url}/v1/chat/completions", timeout=60, json={
        "model": name, "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    ids = served.engine.apply_chat_template(messages)
    want = peft_greedy(smollm2_dir, {name: adapter}, name, ids, 8)
    assert r.json()["choices"][0]["message"]["content"] == AutoTokenizer.from_pretrained(
        smollm2_dir).decode(want, skip_special_tokens=True)

"""Multi-LoRA over real HTTP with the `openai` client: six PEFT adapters of different ranks,
alphas, rsLoRA and target sets, served at once with base-model requests on fewer device
slots (and host copies) than adapters; every greedy answer must equal PEFT's for that
adapter alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.core.config import Settings
from app.main import create_app
from app.server_options import preload_adapters
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.lora.weights import AdapterError
from tests.utils.hf_oracle import hf_greedy, peft_greedy
from tests.utils.live_server import serve_in_thread
from tests.utils.peft_adapters import make_peft_adapter

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> make_peft_adapter arguments
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv-r2": {"r": 2, "alpha": 4, "targets": ("q_proj", "v_proj"), "seed": 1},
    "attn-r8": {
        "r": 8,
        "alpha": 16,
        "targets": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "seed": 2,
    },
    "mlp-r16-rs": {
        "r": 16,
        "alpha": 8,
        "targets": ("gate_proj", "up_proj", "down_proj"),
        "use_rslora": True,
        "seed": 3,
    },
    "all-r64": {"r": 64, "alpha": 32, "targets": ALL_LINEAR, "seed": 4},
    "all-r4-rs": {"r": 4, "alpha": 8, "targets": ALL_LINEAR, "use_rslora": True, "seed": 5},
    "ko-r32": {"r": 32, "alpha": 64, "targets": ("k_proj", "o_proj"), "seed": 6},
}
PROMPTS = ["Tell me about the ocean.", "List three fruits."]


@dataclass
class Served:
    base_url: str
    engine: AsyncEngine
    adapters: dict[str, Path]
    refused: list[str]


@pytest.fixture(scope="module")
def served(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        name: make_peft_adapter(smollm2_dir, root / name, **kwargs)
        for name, kwargs in ADAPTERS.items()
    }
    dora = make_peft_adapter(smollm2_dir, root / "dora", r=4, alpha=8, use_dora=True)
    engine = AsyncEngine(
        EngineConfig(model=str(smollm2_dir), max_num_seqs=32, max_loras=3, max_cpu_loras=4)
    )
    engine.start_sync()
    # A refused adapter among the preloaded ones: logged, the others are served.
    refused = asyncio.run(preload_adapters(engine, {**adapters, "broken-dora": dora}))
    try:
        with serve_in_thread(create_app(engine, Settings(no_auth=True))) as base:
            yield Served(base, engine, adapters, refused)
    finally:
        asyncio.run(engine.shutdown())


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)


def test_models_lists_base_and_adapters(client: openai.OpenAI, served: Served) -> None:
    assert served.refused == ["broken-dora"]
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"SmolLM2-135M-Instruct", *ADAPTERS}
    assert models["all-r64"].model_dump().get("parent") == "SmolLM2-135M-Instruct"


def test_unknown_and_refused_adapters_are_404(client: openai.OpenAI) -> None:
    for name in ("no-such-adapter", "broken-dora"):
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert info.value.code == "model_not_found"


def test_concurrent_adapters_match_peft(
    client: openai.OpenAI, served: Served, smollm2_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    jobs = [(model, prompt) for model in [*ADAPTERS, "SmolLM2-135M-Instruct"] for prompt in PROMPTS]

    def ask(job: tuple[str, str]) -> str:
        model, prompt = job
        resp = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert resp.model == model
        return resp.choices[0].message.content or ""

    # All at once: more adapters than device slots (3) and host copies (4).
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = dict(zip(jobs, pool.map(ask, jobs), strict=True))

    for prompt in PROMPTS:
        ids = served.engine.apply_chat_template([{"role": "user", "content": prompt}])
        base = hf_greedy(smollm2_dir, ids, MAX_TOKENS)
        assert answers["SmolLM2-135M-Instruct", prompt] == tokenizer.decode(
            base, skip_special_tokens=True
        )
        for name in ADAPTERS:
            want = peft_greedy(smollm2_dir, served.adapters, name, ids, MAX_TOKENS)
            assert want != base, f"adapter {name} does not change the base model's answer"
            assert answers[name, prompt] == tokenizer.decode(want, skip_special_tokens=True), (
                name,
                prompt,
            )

    stats = served.engine.stats()
    cache = stats.adapter_cache
    assert cache is not None
    assert cache.num_device <= 3 and cache.device_evictions > 0
    assert cache.host_evictions > 0 and cache.loads > 0  # evicted copies came back from disk


def test_adapter_metrics(served: Served, client: openai.OpenAI) -> None:
    client.completions.create(model="qv-r2", prompt="Hello", max_tokens=2, temperature=0)
    text = httpx.get(f"{served.base_url}/metrics").text
    assert 'loraplex_model_requests_total{model="qv-r2"}' in text
    assert 'loraplex_adapters_resident{tier="device"}' in text
    assert 'loraplex_adapter_evictions_total{tier="device"}' in text
    assert "loraplex_adapter_load_seconds_bucket" in text
    assert 'loraplex_adapter_cache_lookups_total{result="hit"}' in text


def test_refused_adapter_keeps_others_serving(
    served: Served, client: openai.OpenAI, smollm2_dir: Path, tmp_path: Path
) -> None:
    bad = make_peft_adapter(
        smollm2_dir, tmp_path / "lm-head", r=4, alpha=8, targets=("q_proj", "lm_head")
    )
    with pytest.raises(AdapterError, match="lm_head"):
        asyncio.run(served.engine.add_adapter("lm-head", str(bad)))
    assert served.engine.get_adapter("lm-head") is None
    resp = client.completions.create(model="attn-r8", prompt="Hi", max_tokens=3, temperature=0)
    assert resp.choices[0].text

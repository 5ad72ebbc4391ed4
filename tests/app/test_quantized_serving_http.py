"""A quantized base served over HTTP: the `openai` client gets HF's tokens on the
dequantized weights, and /admin/engine and /metrics report the scheme and the bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from engine.config import QuantizationSpec
from tests.utils.hf_oracle import hf_greedy
from tests.utils.quantized import dequantized_checkpoint
from tests.utils.real_service import real_service
from tests.utils.saas import ADMIN_KEY, bearer, create_key, create_tenant

PROMPT = [1, 422, 3107, 314, 253, 1379, 30]
NEW_TOKENS = 12


def test_an_int4_base_serves_hf_tokens_and_reports_its_weights(
    tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    base = tiny_model_factory("llama_gqa")
    oracle = dequantized_checkpoint(base, tmp_path / "oracle", QuantizationSpec("int4"))
    want = hf_greedy(oracle, PROMPT, NEW_TOKENS, ignore_eos=True)
    assert want != hf_greedy(base, PROMPT, NEW_TOKENS, ignore_eos=True)  # int4 shows
    with real_service(base, tmp_path, engine_options={"quantization": "int4",
                                                      "max_loras": 1}) as live, \
            httpx.Client(base_url=live.base_url, timeout=60) as admin:
        tenant = create_tenant(admin, "quantized")
        key = create_key(admin, tenant["id"])["key"]
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0)
        response = client.completions.create(
            model=base.name, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}, logprobs=1)
        tokens = response.choices[0].logprobs.tokens  # type: ignore[union-attr]
        assert tokens is not None and len(tokens) == NEW_TOKENS
        text = response.choices[0].text
        from transformers import AutoTokenizer

        assert text == AutoTokenizer.from_pretrained(base).decode(want)

        view = admin.get("/admin/engine", headers=bearer(ADMIN_KEY)).json()
        [worker] = view["workers"]
        held = live.engine.core.runner.weight_bytes
        assert worker["quantization"] == "int4 (groups of 32)"
        assert worker["weight_bytes"] == held
        metrics = admin.get("/metrics").text
        [family] = [f for f in text_string_to_metric_families(metrics)
                    if f.name == "loraplex_model_weight_bytes"]
        [sample] = family.samples
        assert sample.labels == {"dtype": "float32", "quantization": "int4 (groups of 32)"}
        assert sample.value == held

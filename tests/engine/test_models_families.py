"""Qwen3 and Phi-3 through the model runner: several adapters (and base-model rows) in
one batch, each row token-identical to Hugging Face PEFT running its adapter alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.core.model_runner import ModelRunner
from engine.core.state import Request, ScheduledChunk, SchedulerOutput
from engine.lora.peft import load_peft_adapter
from engine.models.llama import LlamaDecoderLayer
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.request import SamplingParams
from tests.utils.hf_oracle import hf_greedy, peft_greedy
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.tiny_models import random_prompt

NEW_TOKENS = 8
LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# variant -> adapter name -> make_peft_adapter keywords
FAMILY_ADAPTERS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3": {
        "qk": {"r": 4, "alpha": 8, "targets": ("q_proj", "k_proj"), "seed": 21},
        "mlp": {
            "r": 6,
            "alpha": 3,
            "targets": ("gate_proj", "up_proj", "down_proj"),
            "use_rslora": True,
            "seed": 22,
        },
        "all": {"r": 16, "alpha": 8, "targets": LLAMA_LINEAR, "seed": 23},
    },
    "qwen3_bias_untied": {
        "vo": {"r": 2, "alpha": 4, "targets": ("v_proj", "o_proj"), "seed": 24},
        "all": {"r": 8, "alpha": 16, "targets": LLAMA_LINEAR, "seed": 25},
    },
    "phi3": {
        "qkv": {"r": 4, "alpha": 8, "targets": ("qkv_proj",), "seed": 31},
        "mlp": {"r": 6, "alpha": 3, "targets": ("gate_up_proj", "down_proj"), "seed": 32},
        "all": {"r": 16, "alpha": 8, "targets": PHI3_LINEAR, "use_rslora": True, "seed": 33},
    },
}


def _runner(base: Path, max_loras: int) -> ModelRunner:
    config = EngineConfig(
        device="cpu",
        block_size=8,
        kv_cache_tokens=1024,
        max_num_seqs=16,
        max_loras=max_loras,
        max_lora_rank=16,
        num_threads=1,
    )
    return ModelRunner(config, base)


def _batched_greedy(
    runner: ModelRunner, rows: list[tuple[str, list[int], str | None]], slots: dict[str, int]
) -> dict[str, list[int]]:
    """Every request prefilled in one step, then decoded together: one batch mixes all
    adapters and the base model at every step."""
    free = list(range(runner.num_blocks))
    bs = runner.block_size
    requests = []
    for rid, prompt, adapter in rows:
        request = Request(rid, prompt, SamplingParams(temperature=0.0), adapter_id=adapter)
        request.adapter_key = adapter
        requests.append(request)
    for step in range(NEW_TOKENS):
        chunks = []
        for r in requests:
            n = r.num_prompt_tokens if step == 0 else 1
            while len(r.block_ids) * bs < r.num_computed_tokens + n:
                r.block_ids.append(free.pop())
            chunks.append(ScheduledChunk(r, r.num_computed_tokens, n))
        if step > 0:
            assert all(c.num_tokens == 1 for c in chunks)
        logits = runner.execute(SchedulerOutput(chunks), slots)
        assert logits.shape == (len(requests), runner.vocab_size)
        for c, token in zip(chunks, logits.argmax(dim=-1).tolist(), strict=True):
            c.request.num_computed_tokens += c.num_tokens
            c.request.output_token_ids.append(token)
    return {r.request_id: r.output_token_ids for r in requests}


@pytest.mark.parametrize("variant", sorted(FAMILY_ADAPTERS))
def test_mixed_adapter_batch_matches_peft(
    variant: str, tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    base = tiny_model_factory(variant)
    specs = FAMILY_ADAPTERS[variant]
    adapters = {name: make_peft_adapter(base, tmp_path / name, **s) for name, s in specs.items()}
    runner = _runner(base, max_loras=len(adapters))
    assert runner.lora is not None
    slots = {}
    for slot, (name, path) in enumerate(sorted(adapters.items())):
        weights = load_peft_adapter(path, runner.model_config, max_rank=16, name=name)
        runner.lora.install(slot, weights)
        slots[name] = slot
    prompts = [random_prompt(n, seed=n) for n in (5, 19)]
    rows = [
        (f"{name or 'base'}-{i}", prompt, name)
        for i, prompt in enumerate(prompts)
        for name in [*sorted(adapters), None]
    ]
    got = _batched_greedy(runner, rows, slots)
    for i, prompt in enumerate(prompts):
        want_base = hf_greedy(base, prompt, NEW_TOKENS, ignore_eos=True)
        assert got[f"base-{i}"] == want_base
        for name in adapters:
            want = peft_greedy(base, adapters, name, prompt, NEW_TOKENS)
            assert len(want) == NEW_TOKENS
            assert want != want_base, name  # the adapter really changes the answer
            assert got[f"{name}-{i}"] == want, (variant, name, i)


@pytest.mark.parametrize(
    ("variant", "arch"), [("qwen3", Qwen3ForCausalLM), ("phi3", Phi3ForCausalLM)]
)
def test_runner_builds_the_registered_class(
    variant: str, arch: type, tiny_model_factory: Callable[[str], Path]
) -> None:
    runner = _runner(tiny_model_factory(variant), max_loras=1)
    assert type(runner.model) is arch
    assert runner.lora is not None
    assert set(runner.lora.group_modules) == {"qkv", "o", "gate_up", "down"}
    assert runner.lora.group_modules == arch.lora_groups


def test_phi3_lora_groups_are_single_fused_modules(
    tiny_model_factory: Callable[[str], Path],
) -> None:
    """A Phi-3 group carries one adapter module whose output spans the whole fused linear."""
    runner = _runner(tiny_model_factory("phi3"), max_loras=1)
    cfg = runner.model_config
    assert runner.lora is not None
    layer0 = runner.lora.groups[0]
    assert layer0["qkv"].slice_sizes == (cfg.q_size + 2 * cfg.kv_size,)
    assert layer0["gate_up"].slice_sizes == (2 * cfg.intermediate_size,)
    assert layer0["o"].in_features == cfg.q_size
    assert layer0["down"].in_features == cfg.intermediate_size


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("variant", ["qwen3", "phi3"])
def test_plain_and_packed_cpu_linears_give_the_same_tokens(
    variant: str, pack: bool, tiny_model_factory: Callable[[str], Path]
) -> None:
    from engine.models.cpu_linear import PackedLinear, packing_available

    if pack and not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN linear ops")
    base = tiny_model_factory(variant)
    config = EngineConfig(
        device="cpu", block_size=8, kv_cache_tokens=512, pack_cpu_weights=pack, num_threads=1
    )
    runner = ModelRunner(config, base)
    layer = runner.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) == pack
    assert isinstance(runner.model.lm_head, PackedLinear) == pack  # tied or not
    prompt = random_prompt(13, seed=5)
    got = _batched_greedy(runner, [("a", prompt, None)], {})
    assert got["a"] == hf_greedy(base, prompt, NEW_TOKENS, ignore_eos=True)

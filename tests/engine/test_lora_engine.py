"""Multi-LoRA in the engine on tiny random models: mixed batches of adapters (and base
requests) must give each request exactly what PEFT gives for its adapter alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.client import RequestRejected
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.lora.weights import AdapterError
from engine.request import EngineRequest, SamplingParams
from tests.utils.hf_oracle import hf_greedy, peft_greedy
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.tiny_models import random_prompt

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS: dict[str, dict[str, Any]] = {
    "qv": {"r": 2, "alpha": 4, "targets": ("q_proj", "v_proj"), "seed": 11},
    "attn": {"r": 8, "alpha": 16, "targets": ("q_proj", "k_proj", "v_proj", "o_proj"), "seed": 12},
    "mlp": {
        "r": 5,
        "alpha": 3,
        "targets": ("gate_proj", "up_proj", "down_proj"),
        "use_rslora": True,
        "seed": 13,
    },
    "all": {"r": 16, "alpha": 8, "targets": ALL_LINEAR, "seed": 14},
}
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_with_adapters(
    tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Path]]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("tiny_adapters")
    adapters = {name: make_peft_adapter(base, root / name, **spec) for name, spec in SPECS.items()}
    return base, adapters


def make_core(base: Path, **overrides: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=str(base), **overrides))


def greedy(rid: str, prompt: list[int], adapter: str | None) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
        adapter=adapter,
    )


def run(
    core: EngineCore, requests: list[EngineRequest], max_steps: int = 2000
) -> dict[str, list[int]]:
    for r in requests:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        result = core.step()
        if result.idle:
            time.sleep(0.01)  # adapters loading in the background
        for out in result.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not core.has_unfinished_requests(), "engine did not finish"
    return tokens


def test_mixed_batch_matches_peft_per_adapter(tiny_with_adapters) -> None:
    base, adapters = tiny_with_adapters
    # Fewer device slots (2) and host copies (3) than adapters (4): slots are reused and
    # evicted host copies come back from disk while requests wait.
    check_mixed_batch(base, adapters, prompt_lengths=(5, 17, 33))


def check_mixed_batch(
    base: Path, adapters: dict[str, Path], *, prompt_lengths: tuple[int, ...],
    label: str = "",
) -> None:
    """Every adapter and the base model on each prompt, in one engine whose slots (2) and
    host copies (3) are fewer than the adapters: token-identical to HF (PEFT)."""
    core = make_core(base, max_loras=2, max_cpu_loras=3, max_lora_rank=16)
    for name, path in adapters.items():
        core.add_adapter(name, path)
    prompts = [random_prompt(n, seed=n) for n in prompt_lengths]
    requests = [
        greedy(f"{name or 'base'}-{i}", prompt, name)
        for i, prompt in enumerate(prompts)
        for name in [*adapters, None]
    ]
    got = run(core, requests)
    for i, prompt in enumerate(prompts):
        want_base = hf_greedy(base, prompt, NEW_TOKENS, ignore_eos=True)
        assert got[f"base-{i}"] == want_base
        for name in adapters:
            want = peft_greedy(base, adapters, name, prompt, NEW_TOKENS)
            assert want != want_base, name
            assert got[f"{name}-{i}"] == want, (label, name, i)
    stats = core.adapter_cache.stats() if core.adapter_cache else None
    assert stats is not None and stats.device_evictions > 0
    # Every pin was released: nothing holds a slot once all requests finished.
    cache = core.adapter_cache
    assert cache is not None
    on_device = [a.key for a in core.list_adapters() if cache.slot_of(a.key) is not None]
    assert len(on_device) == 2 and sorted(cache.device_eviction_order()) == sorted(on_device)


def test_unknown_adapter_is_rejected(tiny_with_adapters) -> None:
    base, _ = tiny_with_adapters
    core = make_core(base, max_loras=1)
    with pytest.raises(RequestRejected) as info:
        core.add_request(greedy("x", [5, 6, 7], "nope"))
    assert info.value.code == "model_not_found"
    assert not core.has_unfinished_requests()


def test_refused_adapter_leaves_engine_serving(tiny_with_adapters, tmp_path: Path) -> None:
    base, adapters = tiny_with_adapters
    core = make_core(base, max_loras=2, max_lora_rank=8)
    core.add_adapter("qv", adapters["qv"])
    with pytest.raises(AdapterError, match="max-lora-rank"):
        core.add_adapter("all", adapters["all"])  # rank 16 > 8
    assert [a.name for a in core.list_adapters()] == ["qv"]
    got = run(core, [greedy("a", [9, 10, 11], "qv")])
    assert got["a"] == peft_greedy(base, adapters, "qv", [9, 10, 11], NEW_TOKENS)


def test_replacing_an_adapter_drops_its_prefix_cache(tiny_with_adapters) -> None:
    base, adapters = tiny_with_adapters
    core = make_core(base, max_loras=2)
    prompt = random_prompt(40, seed=3)
    core.add_adapter("x", adapters["qv"])
    first = run(core, [greedy("a", prompt, "x")])["a"]
    hits_before = core.block_manager.prefix_cache_hits
    run(core, [greedy("b", prompt, "x")])
    assert core.block_manager.prefix_cache_hits > hits_before  # same version: reused
    core.add_adapter("x", adapters["attn"])  # new version under the same name
    hits_before = core.block_manager.prefix_cache_hits
    got = run(core, [greedy("c", prompt, "x")])["c"]
    assert core.block_manager.prefix_cache_hits == hits_before  # nothing reused
    assert got == peft_greedy(base, adapters, "attn", prompt, NEW_TOKENS) != first


def test_removed_adapter_finishes_in_flight_requests(tiny_with_adapters) -> None:
    base, adapters = tiny_with_adapters
    core = make_core(base, max_loras=1)
    core.add_adapter("qv", adapters["qv"])
    prompt = [20, 21, 22, 23]
    core.add_request(greedy("a", prompt, "qv"))
    core.step()
    assert core.remove_adapter("qv")
    with pytest.raises(RequestRejected):
        core.add_request(greedy("b", prompt, "qv"))
    rest = run(core, [])
    assert core.get_adapter("qv") is None
    assert rest["a"] and len(rest["a"]) == NEW_TOKENS - 1  # finished on the removed adapter
    assert core.adapter_cache is not None and core.adapter_cache.stats().num_device == 0


def test_resident_adapter_does_not_wait_for_another_load(
    tiny_with_adapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, adapters = tiny_with_adapters
    core = make_core(base, max_loras=2, max_cpu_loras=1)
    core.add_adapter("qv", adapters["qv"])
    core.add_adapter("attn", adapters["attn"])  # evicts qv's host copy (capacity 1)
    run(core, [greedy("warm", [5, 6], "attn")])  # attn now in a device slot
    release = threading.Event()
    original = core.adapters.reload

    def slow_reload(key: str):  # type: ignore[no-untyped-def]
        release.wait(30)
        return original(key)

    monkeypatch.setattr(core.adapter_cache, "_load", slow_reload)
    core.add_request(greedy("blocked", [7, 8, 9], "qv"))  # needs a disk load
    core.add_request(greedy("resident", [7, 8, 9], "attn"))
    done: set[str] = set()
    for _ in range(200):
        for out in core.step().outputs:
            if out.finished:
                done.add(out.request_id)
        if "resident" in done:
            break
    assert "resident" in done and "blocked" not in done
    release.set()
    got = run(core, [])
    assert len(got["blocked"]) == NEW_TOKENS and not core.has_unfinished_requests()


@torch.inference_mode()
def test_base_requests_untouched_by_lora_slots(tiny_with_adapters) -> None:
    base, adapters = tiny_with_adapters
    core = make_core(base, max_loras=2)
    core.add_adapter("all", adapters["all"])
    prompt = random_prompt(12, seed=9)
    got = run(core, [greedy("base", prompt, None), greedy("lora", prompt, "all")])
    assert got["base"] == hf_greedy(base, prompt, NEW_TOKENS, ignore_eos=True)


def test_abort_releases_the_adapter_pin_and_reservation(tiny_with_adapters) -> None:
    base, adapters = tiny_with_adapters
    core = make_core(base, max_loras=1, max_num_seqs=1)
    core.add_adapter("qv", adapters["qv"])
    core.add_adapter("mlp", adapters["mlp"])
    key_qv = core.get_adapter("qv").key  # type: ignore[union-attr]
    key_mlp = core.get_adapter("mlp").key  # type: ignore[union-attr]
    cache = core.adapter_cache
    assert cache is not None
    core.add_request(greedy("running", [5, 6, 7], "qv"))
    core.add_request(greedy("waiting", [5, 6, 7], "mlp"))  # max_num_seqs 1: it waits
    core.step()
    assert cache.device_eviction_order() == []  # qv pinned by the running request
    pins = {r.key: (r.pins, r.reservations) for r in cache.resident()}
    assert pins[key_qv] == (1, 0) and pins[key_mlp] == (0, 1)
    core.abort_request("running")
    core.abort_request("waiting")
    pins = {r.key: (r.pins, r.reservations) for r in cache.resident()}
    assert pins[key_qv] == (0, 0) and pins[key_mlp] == (0, 0)
    assert cache.device_eviction_order() == [key_qv]
    assert not core.has_unfinished_requests()


def test_a_request_keeps_its_adapter_name_and_runs_on_the_version_it_was_bound_to(
    tiny_with_adapters,
) -> None:
    base, adapters = tiny_with_adapters
    core = make_core(base, max_loras=2)
    first = core.add_adapter("x", adapters["qv"])
    state = core.add_request(greedy("a", [5, 6, 7], "x"))
    second = core.add_adapter("x", adapters["mlp"])  # a new version while "a" waits
    assert (state.adapter_id, state.adapter_key) == ("x", first.key)
    later = core.add_request(greedy("b", [5, 6, 7], "x"))
    assert (later.adapter_id, later.adapter_key) == ("x", second.key)
    got = run(core, [])
    assert got["a"] == peft_greedy(base, adapters, "qv", [5, 6, 7], NEW_TOKENS)
    assert got["b"] == peft_greedy(base, adapters, "mlp", [5, 6, 7], NEW_TOKENS)


def test_a_request_whose_adapter_cannot_be_loaded_fails_alone(
    tiny_with_adapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, adapters = tiny_with_adapters
    core = make_core(base, max_loras=2, max_cpu_loras=1)
    core.add_adapter("qv", adapters["qv"])
    core.add_adapter("attn", adapters["attn"])  # evicts qv's host copy: it loads from disk
    cache = core.adapter_cache
    assert cache is not None

    reload = core.adapters.reload

    def broken_reload(key: str) -> Any:
        if key.startswith("qv#"):
            raise AdapterError(f"{key}: the directory is gone")
        return reload(key)

    monkeypatch.setattr(cache, "_load", broken_reload)
    core.add_request(greedy("lost", [5, 6, 7], "qv"))
    core.add_request(greedy("fine", [5, 6, 7], "attn"))
    failures: dict[str, BaseException] = {}
    done: set[str] = set()
    for _ in range(200):
        result = core.step()
        failures.update(result.failures)
        done.update(out.request_id for out in result.outputs if out.finished)
        if not core.has_unfinished_requests():
            break
        if result.idle:
            time.sleep(0.01)  # adapter loads run on the loader thread
    assert list(failures) == ["lost"] and done == {"fine"}
    assert str(failures["lost"]).startswith("adapter 'qv' could not be loaded: ")
    assert "the directory is gone" in str(failures["lost"])
    assert all(r.pins == 0 and r.reservations == 0 for r in cache.resident())


@pytest.mark.parametrize("name", ["", "has space", "x@2", "-leading", "a" * 129])
def test_invalid_adapter_names_are_refused(tiny_with_adapters, name: str) -> None:
    base, adapters = tiny_with_adapters
    core = make_core(base, max_loras=1)
    with pytest.raises(AdapterError, match="invalid adapter name"):
        core.add_adapter(name, adapters["qv"])
    with pytest.raises(AdapterError, match="base model"):
        core.add_adapter(base.name, adapters["qv"])
    assert core.list_adapters() == []


# ---------------------------------------------------------------------------- Qwen3, Phi-3

FAMILY_SPECS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3": {
        "qk": {"r": 4, "alpha": 8, "targets": ("q_proj", "k_proj"), "seed": 41},
        "mlp": {"r": 6, "alpha": 3, "targets": ("gate_proj", "up_proj", "down_proj"), "seed": 42},
        "all": {"r": 16, "alpha": 8, "targets": ALL_LINEAR, "use_rslora": True, "seed": 43},
    },
    # Phi-3 checkpoints fuse q/k/v and gate/up; its adapters target the fused modules.
    "phi3": {
        "qkv": {"r": 4, "alpha": 8, "targets": ("qkv_proj",), "seed": 51},
        "mlp": {"r": 6, "alpha": 3, "targets": ("gate_up_proj", "down_proj"), "seed": 52},
        "all": {
            "r": 16,
            "alpha": 8,
            "targets": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
            "seed": 53,
        },
    },
}


@pytest.mark.parametrize("variant", sorted(FAMILY_SPECS))
def test_qwen3_and_phi3_mixed_batches_match_peft_per_adapter(
    variant: str, tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    base = tiny_model_factory(variant)
    adapters = {
        name: make_peft_adapter(base, tmp_path / name, **spec)
        for name, spec in FAMILY_SPECS[variant].items()
    }
    # Fewer device slots (2) than adapters (3): slots are reused while requests wait.
    check_mixed_batch(base, adapters, prompt_lengths=(6, 21), label=variant)

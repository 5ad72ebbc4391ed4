"""The model registry: a config's model_type finds its class, and the class alone is what
the config parser, the PEFT loader, the memory model and the adapter-size bound ask."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from bench.harness.adapters import write_random_adapter
from engine.async_engine import max_adapter_bytes
from engine.core.memory import adapter_slot_bytes, count_parameters
from engine.lora.peft import load_peft_adapter
from engine.lora.weights import AdapterError
from engine.models import registry
from engine.models.config import ArchFields
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import ModelConfig, ModelLoadError, parse_model_config
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.tiny_models import BASE_SETTINGS, VARIANTS

_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(registry, "_BY_MODEL_TYPE", dict(registry._BY_MODEL_TYPE))
    monkeypatch.setattr(registry, "_BY_ARCHITECTURE", dict(registry._BY_ARCHITECTURE))


def test_supported_types_come_from_the_registered_classes() -> None:
    assert registry.supported_model_types() == ("llama", "mistral", "phi3", "qwen2", "qwen3")
    assert registry.model_class("mistral") is LlamaForCausalLM
    assert registry.model_class("qwen3") is Qwen3ForCausalLM
    assert registry.model_class("phi3") is Phi3ForCausalLM


def test_unknown_model_type_is_refused_with_the_registry_list() -> None:
    with pytest.raises(ModelLoadError) as e:
        parse_model_config({**_LLAMA, "model_type": "gpt2"}, source="x/config.json")
    assert str(e.value) == (
        "unsupported model_type 'gpt2' in x/config.json; "
        "supported: llama, mistral, phi3, qwen2, qwen3"
    )
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'; supported: llama"):
        registry.model_class("gpt2")


def test_a_new_architecture_registers_by_its_class_alone(isolated_registry: None) -> None:
    class WideMLP(LlamaForCausalLM):
        """A stand-in family: the Llama layout, its own model type and config reading."""

        model_types = ("widemlp",)
        architectures: ClassVar[dict[str, str]] = {"WideMLPForCausalLM": "widemlp"}
        required_keys = ("mlp_ratio",)

        @classmethod
        def arch_fields(cls, raw: dict[str, Any], source: str) -> ArchFields:
            return ArchFields(mlp_bias=True, sliding_window=32)

    raw = {**_LLAMA, "model_type": "widemlp"}
    with pytest.raises(ModelLoadError, match="unsupported model_type 'widemlp'"):
        parse_model_config(raw)
    registry.register(WideMLP)
    assert "widemlp" in registry.supported_model_types()
    with pytest.raises(ModelLoadError, match="is missing 'mlp_ratio'"):
        parse_model_config(raw)
    cfg = parse_model_config({**raw, "mlp_ratio": 2})
    assert (cfg.model_type, cfg.mlp_bias, cfg.sliding_window, cfg.max_model_len) == (
        "widemlp",
        True,
        32,
        32,
    )
    assert registry.model_class_for(cfg) is WideMLP
    # Found by its architecture name when config.json has no model_type.
    by_arch = {k: v for k, v in raw.items() if k != "model_type"}
    by_arch.update(architectures=["WideMLPForCausalLM"], mlp_ratio=2)
    assert parse_model_config(by_arch).model_type == "widemlp"
    # The memory model counts what its class counts: mlp biases included.
    plain = parse_model_config(_LLAMA)
    assert count_parameters(cfg) - count_parameters(plain) == 3 * (2 * 96 + 64)


def test_config_without_model_type_is_found_by_architecture() -> None:
    raw = {k: v for k, v in _LLAMA.items() if k != "model_type"}
    raw["architectures"] = ["Qwen3ForCausalLM"]
    assert parse_model_config({**raw, "head_dim": 16}).model_type == "qwen3"
    with pytest.raises(ModelLoadError, match="unsupported model_type None"):
        parse_model_config({**raw, "architectures": ["GPT2LMHeadModel"]})


def test_qwen3_needs_an_explicit_head_dim() -> None:
    # Without head_dim, transformers would use 128, not hidden_size / num_heads.
    with pytest.raises(ModelLoadError, match="is missing 'head_dim'"):
        parse_model_config({**_LLAMA, "model_type": "qwen3"})
    cfg = parse_model_config({**_LLAMA, "model_type": "qwen3", "head_dim": 32})
    assert (cfg.head_dim, cfg.q_size, cfg.qkv_bias, cfg.o_bias) == (32, 128, False, False)
    biased = parse_model_config(
        {**_LLAMA, "model_type": "qwen3", "head_dim": 32, "attention_bias": True}
    )
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias) == (True, True, False)


def test_phi3_config_reading() -> None:
    phi3 = {**_LLAMA, "model_type": "phi3", "max_position_embeddings": 4096}
    cfg = parse_model_config({**phi3, "sliding_window": 2047})
    assert (cfg.sliding_window, cfg.max_model_len) == (2047, 2047)
    assert parse_model_config(phi3).sliding_window is None
    partial = {**phi3, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 0\.75 is not supported"):
        parse_model_config(partial)
    longrope = {**phi3, "rope_scaling": {"type": "longrope", "short_factor": [1.0]}}
    with pytest.raises(ModelLoadError, match="rope scaling type 'longrope' is not supported"):
        parse_model_config(longrope)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_linear_shapes_match_the_transformers_modules(variant: str) -> None:
    """The one shape table of each class against the linears of the real HF model."""
    model_type, overrides = VARIANTS[variant]
    settings = {**BASE_SETTINGS, **overrides, "vocab_size": 512}
    hf_config = AutoConfig.for_model(model_type, **settings)
    hf_model = AutoModelForCausalLM.from_config(hf_config)
    cfg = parse_model_config(hf_config.to_dict())
    arch = registry.model_class_for(cfg)
    linears = {
        name.rsplit(".", 2)[-2:][0] + "." + name.rsplit(".", 1)[-1]: module
        for name, module in hf_model.named_modules()
        if name.startswith("model.layers.0.") and hasattr(module, "in_features")
    }
    want = {
        f"{arch.module_parents[m]}.{m}": (fin, fout)
        for m, (fin, fout) in arch.linear_shapes(cfg).items()
    }
    got = {name: (m.in_features, m.out_features) for name, m in linears.items()}
    assert got == want
    assert arch.target_modules() == set(arch.linear_shapes(cfg))


def _phi3_cfg(tiny_model_factory: Callable[[str], Path]) -> tuple[Path, ModelConfig]:
    from engine.models.loader import validate_model_dir

    base = tiny_model_factory("phi3")
    return base, validate_model_dir(base)


def test_phi3_adapter_b_rows_rope_interleaved_on_q_and_k_only(
    tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    from loraplex_kernels.reference import interleave_rope_rows
    from tests.utils.peft_adapters import lora_tensor_name, read_adapter_tensors

    base, cfg = _phi3_cfg(tiny_model_factory)
    adapter = make_peft_adapter(base, tmp_path / "a", r=4, targets=("qkv_proj", "o_proj"))
    weights = load_peft_adapter(adapter, cfg, max_rank=4)
    tensors = read_adapter_tensors(adapter)
    assert set(weights.modules) == {(i, m) for i in range(2) for m in ("qkv_proj", "o_proj")}
    qk = cfg.q_size + cfg.kv_size
    for layer in range(cfg.num_layers):
        b = tensors[lora_tensor_name(layer, "qkv_proj", "lora_B", Phi3ForCausalLM)]
        loaded = weights.modules[(layer, "qkv_proj")].b
        assert loaded.shape == (cfg.q_size + 2 * cfg.kv_size, 4)
        assert not loaded[:qk].equal(b[:qk])
        assert loaded[:qk].equal(interleave_rope_rows(b[:qk], cfg.head_dim))
        assert loaded[qk:].equal(b[qk:])  # v rows are not rotated
        o_b = tensors[lora_tensor_name(layer, "o_proj", "lora_B", Phi3ForCausalLM)]
        assert weights.modules[(layer, "o_proj")].b.equal(o_b)


def test_llama_module_names_are_refused_on_phi3(
    tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    _, cfg = _phi3_cfg(tiny_model_factory)
    llama_cfg = parse_model_config(
        {**_LLAMA, "num_hidden_layers": 2, "intermediate_size": cfg.intermediate_size}
    )
    adapter = write_random_adapter(tmp_path / "llama", llama_cfg, rank=2, alpha=4)
    with pytest.raises(
        AdapterError,
        match=r"target_modules includes k_proj, q_proj, v_proj, which cannot be adapted "
        r"\(supported: down_proj, gate_up_proj, o_proj, qkv_proj, or 'all-linear'\)",
    ):
        load_peft_adapter(adapter, cfg, max_rank=4)
    # Without target_modules the tensors themselves are checked against the class.
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2}')
    refused = r"adapts model\.layers\.0\.self_attn\.[kqv]_proj, which cannot be adapted"
    with pytest.raises(AdapterError, match=refused):
        load_peft_adapter(adapter, cfg, max_rank=4)
    phi3_adapter = write_random_adapter(
        tmp_path / "phi3", cfg, rank=2, alpha=4, targets=("qkv_proj", "gate_up_proj")
    )
    loaded = load_peft_adapter(phi3_adapter, cfg, max_rank=4)
    assert loaded.target_modules == {"qkv_proj", "gate_up_proj"}
    assert loaded.modules[(1, "gate_up_proj")].a.shape == (2, cfg.hidden_size)


@pytest.mark.parametrize("variant", ["llama_gqa", "qwen3", "phi3"])
def test_adapter_size_bounds_follow_the_class_shapes(variant: str) -> None:
    model_type, overrides = VARIANTS[variant]
    cfg = parse_model_config({**BASE_SETTINGS, **overrides, "model_type": model_type})
    shapes = registry.model_class_for(cfg).linear_shapes(cfg)
    per_layer = sum(fin + fout for fin, fout in shapes.values())
    assert adapter_slot_bytes(cfg, 3, 8, "bfloat16") == 3 * 8 * per_layer * 2 * 2
    tensors = 2 * len(shapes) * cfg.num_layers
    assert max_adapter_bytes(cfg, 8) == 4 * 8 * per_layer * 2 + 256 * tensors + (1 << 20)
    # Phi-3's fused modules are fewer tensors for the same parameters as Llama's seven.
    assert len(shapes) == (4 if model_type == "phi3" else 7)

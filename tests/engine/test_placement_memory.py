"""The placement memory model against the engine's own allocations and HF's parameter counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.core.memory import (
    CUDA_CONTEXT_BYTES,
    GIB,
    MemoryModel,
    WorkerShape,
    adapter_slot_bytes,
    base_weight_bytes,
    count_parameters,
    kv_bytes_per_token,
)
from engine.lora.layers import LoRAGroup
from engine.models.attention import allocate_kv_cache
from engine.models.loader import load_model_config, parse_model_config
from engine.models.registry import model_class_for
from tests.utils.tiny_models import BASE_SETTINGS, VARIANTS

MODELS = Path(__file__).parents[1] / "fixtures" / "placement" / "models"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parameter_count_matches_transformers(variant: str) -> None:
    model_type, overrides = VARIANTS[variant]
    settings = {**BASE_SETTINGS, **overrides, "vocab_size": 512}
    hf_config = AutoConfig.for_model(model_type, **settings)
    hf_model = AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in hf_model.parameters())  # tied weights counted once
    cfg = parse_model_config(hf_config.to_dict())
    assert count_parameters(cfg) == expected


def test_parameter_count_of_known_models() -> None:
    smollm2 = load_model_config(MODELS / "smollm2-135m")
    llama3 = load_model_config(MODELS / "llama-3-8b")
    assert count_parameters(smollm2) == 134_515_008
    assert count_parameters(llama3) == 8_030_261_248


# Published sizes: Phi-3-mini (3.82B) and Qwen3-8B (8.19B).
_PHI3_MINI = {
    "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "tie_word_embeddings": False,
}
_QWEN3_8B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
}


def test_parameter_count_of_known_qwen3_and_phi3_models() -> None:
    assert count_parameters(parse_model_config(_PHI3_MINI)) == 3_821_079_552
    assert count_parameters(parse_model_config(_QWEN3_8B)) == 8_190_735_360


def test_phi3_adapter_slots_match_the_engine_buffers() -> None:
    """Phi-3's groups are single fused modules: one slice spanning the fused output."""
    cfg = parse_model_config(_PHI3_MINI)
    slots, rank = 2, 16
    groups = {
        "qkv": (cfg.hidden_size, (cfg.q_size + 2 * cfg.kv_size,)),
        "o": (cfg.q_size, (cfg.hidden_size,)),
        "gate_up": (cfg.hidden_size, (2 * cfg.intermediate_size,)),
        "down": (cfg.intermediate_size, (cfg.hidden_size,)),
    }
    per_layer = 0
    for fin, sizes in groups.values():
        group = LoRAGroup(slots, rank, fin, sizes, device=torch.device("meta"),
                          dtype=torch.bfloat16, use_kernels=True)
        per_layer += (group.lora_a.numel() + group.lora_b.numel()) * 2
    assert adapter_slot_bytes(cfg, slots, rank, "bfloat16") == per_layer * cfg.num_layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_bytes_per_token_match_the_engine_cache(dtype: str) -> None:
    cfg = load_model_config(MODELS / "smollm2-135m")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    num_blocks, block_size = 2, 16
    caches = allocate_kv_cache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                               cfg.head_dim, torch_dtype, torch.device("meta"))
    total = sum(t.numel() * t.element_size() for c in caches for t in (c.key, c.value))
    assert kv_bytes_per_token(cfg, dtype) == total // (num_blocks * block_size)
    assert kv_bytes_per_token(cfg, "bfloat16") == 2 * 30 * 3 * 64 * 2


def test_adapter_slots_match_the_engine_buffers() -> None:
    """The stacked slot buffers the CUDA path allocates, built on the meta device."""
    cfg = load_model_config(MODELS / "llama-3-8b")
    slots, rank = 4, 32
    groups = {  # as LlamaForCausalLM.enable_lora builds them
        "qkv": (cfg.hidden_size, (cfg.q_size, cfg.kv_size, cfg.kv_size)),
        "o": (cfg.q_size, (cfg.hidden_size,)),
        "gate_up": (cfg.hidden_size, (cfg.intermediate_size, cfg.intermediate_size)),
        "down": (cfg.intermediate_size, (cfg.hidden_size,)),
    }
    per_layer = 0
    for fin, sizes in groups.values():
        group = LoRAGroup(slots, rank, fin, sizes, device=torch.device("meta"),
                          dtype=torch.bfloat16, use_kernels=True)
        per_layer += (group.lora_a.numel() + group.lora_b.numel()) * 2
    assert adapter_slot_bytes(cfg, slots, rank, "bfloat16") == per_layer * cfg.num_layers


@pytest.mark.parametrize("device_gib", [4.75, 9.5, 16.0, 39.25, 79.19])
def test_kv_cache_tokens_is_the_most_that_fits(device_gib: float) -> None:
    cfg = load_model_config(MODELS / "llama-3-8b")
    model = MemoryModel(cfg, WorkerShape())
    device = int(device_gib * GIB)
    tokens = model.kv_cache_tokens(device)
    if device_gib < 20:  # 8B weights (14.96 GiB) + 2.5 GiB of adapter slots + the rest
        assert tokens == 0
        return
    assert tokens % 16 == 0
    limit = int(device * 0.9)  # gpu_memory_utilization's default
    assert model.breakdown(tokens).total <= limit < model.breakdown(tokens + 16).total


def test_breakdown_parts() -> None:
    cfg = load_model_config(MODELS / "llama-3-8b")
    model = MemoryModel(cfg, WorkerShape(dtype="bfloat16", max_loras=8, max_lora_rank=64))
    parts = model.breakdown(kv_cache_tokens=4096)
    assert parts.weights == 8_030_261_248 * 2
    assert parts.kv_cache == 4096 * 2 * 32 * 8 * 128 * 2
    assert parts.adapters == 8 * 64 * 32 * 2 * (
        (4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 3 * (4096 + 14336)
    )
    assert parts.cuda_context == CUDA_CONTEXT_BYTES
    assert parts.total == (parts.weights + parts.kv_cache + parts.adapters + parts.activations
                           + parts.cuda_context)
    assert parts.as_gib()["weights_gb"] == 14.96
    per_token = (4 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336) * 2 + 7 * 64 * 4
    assert parts.activations == (
        2 * 2048 * per_token  # layer intermediates of a full step, x2
        + 3 * 64 * 128256 * 4  # float32 logits, probabilities, sorted copy
        + 2048 * 8192  # prefill masks
        + 4096 * 131072 // 32  # one layer's K/V gathered for decode
    )
    assert parts.describe() == (
        "19.62 GiB (weights 14.96 + KV cache 0.50 for 4096 tokens + adapters 2.50 + "
        "activations 0.66 + CUDA context 1.00)"
    )
    # More sequences per step need more logits memory; the rest does not change.
    assert model.breakdown(4096, max_num_seqs=128).activations > parts.activations
    assert model.kv_tokens_for(concurrency=3, context=100) == 3 * 112


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"max_loras": 0}, "max_loras must be >= 1"),
        ({"block_size": 24}, "block_size must be a positive power of two"),
    ],
)
def test_worker_shape_refuses_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerShape(**kwargs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(("scheme", "group"), [("int8", None), ("int8", 32), ("int4", None),
                                               ("int4", 64), ("fp8", None)])
def test_quantized_weights_match_the_gpu_layouts(variant: str, scheme: str,
                                                 group: int | None) -> None:
    """base_weight_bytes against the layouts a GPU worker quantizes into (device_quant.py;
    the meta device stands in for the GPU: only the sizes are read)."""
    from engine.config import QuantizationSpec
    from engine.models.quantized import QuantLinear, quantize_linears

    model_type, overrides = VARIANTS[variant]
    settings = {**BASE_SETTINGS, **overrides, "vocab_size": 512}
    hf_config = AutoConfig.for_model(model_type, **settings)
    hf_model = AutoModelForCausalLM.from_config(hf_config)
    cfg = parse_model_config(hf_config.to_dict())
    dense = base_weight_bytes(cfg, "bfloat16")
    assert dense == count_parameters(cfg) * 2
    spec = QuantizationSpec(scheme, group)
    if group is not None and any(fin % group for fin, _ in
                                 model_class_for(cfg).linear_shapes(cfg).values()):
        # A group that does not divide a layer's inputs: refused by both, in one line.
        with pytest.raises(ValueError, match=f"group size {group} does not divide"):
            base_weight_bytes(cfg, "bfloat16", scheme, group)
        with pytest.raises(ValueError, match=f"group size {group} does not divide"):
            quantize_linears(hf_model.model.layers, spec, "meta")
        return
    quantize_linears(hf_model.model.layers, spec, "meta")
    held = sum(p.numel() * 2 for p in hf_model.parameters())  # tied tables once
    for module in hf_model.modules():
        if isinstance(module, QuantLinear):
            held += module.quantized.nbytes
            held += 0 if module.bias_f32 is None else module.bias_f32.numel() * 2
    want = base_weight_bytes(cfg, "bfloat16", scheme, group)
    assert want == held < dense


def test_plan_memory_follows_the_quantization() -> None:
    llama3 = load_model_config(MODELS / "llama-3-8b")
    bf16 = MemoryModel(llama3, WorkerShape())
    int4 = MemoryModel(llama3, WorkerShape(quantization="int4"))
    fp8 = MemoryModel(llama3, WorkerShape(quantization="fp8"))
    # Llama-3-8B: 6.98B decoder linear parameters of 8.03B; int4 in groups of 32 holds
    # 4 + 2 x 32 / 32 bits a weight (float32 scales and offsets), the 1.05B embedding and
    # output parameters in bf16.
    assert bf16.weights == 8_030_261_248 * 2
    assert abs(int4.weights / GIB - 6.83) < 0.01
    assert abs(fp8.weights / GIB - 8.46) < 0.01
    # The bytes saved go to the KV cache on the same device.
    device = 24 * GIB
    assert int4.kv_cache_tokens(device) > fp8.kv_cache_tokens(device) > bf16.kv_cache_tokens(
        device) > 0
    for shape, message in ((dict(quantization="w8a8"), "does not serve --quantization w8a8"),
                           (dict(quantization="int4", quantization_group_size=7), "even"),
                           (dict(quantization_group_size=32), "int8 and int4 only")):
        with pytest.raises(ValueError, match=message):
            WorkerShape(**shape)

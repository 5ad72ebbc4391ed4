"""Random LoRA adapters in PEFT's on-disk format, written directly (no peft needed), for
benchmarks: `adapter_config.json` + `adapter_model.safetensors`."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.loader import ModelConfig
from engine.models.registry import model_class_for

# Llama-family module names (Llama, Mistral, Qwen2, Qwen3).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


def write_random_adapter(
    out_dir: Path,
    config: ModelConfig,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str] = ATTENTION,
    seed: int = 0,
    base_model: str = "",
) -> Path:
    """A PEFT LoRA directory with seeded random factors of a modest effect. `targets`:
    module names of the config's architecture (its class's linear_shapes)."""
    arch = model_class_for(config)
    shapes = arch.linear_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_layers):
        for module in targets:
            fin, fout = shapes[module]
            part = arch.module_parents[module]
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            std = 1.0 / math.sqrt(fin)
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fin, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fout, rank, generator=generator) * (
                0.02 / math.sqrt(rank)
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out_dir

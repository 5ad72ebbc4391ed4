"""Real PEFT LoRA adapters, written by the `peft` library, and broken variants of them.

`make_peft_adapter` injects LoRA layers into a base model with `get_peft_model`, draws
both factors from a seeded generator (PEFT starts B at zero, which would be a no-op), and
saves with `save_pretrained`. The base model is loaded once per directory and restored
after each adapter, so writing many adapters for SmolLM2 costs one model load.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch

from engine.models.base import CausalLM
from engine.models.llama import LlamaForCausalLM

# Without an explicit std, factors are drawn so that each module's dense delta
# (scaling * B @ A) has this element std relative to the base weight it adapts: strong
# enough to change SmolLM2's greedy answers while its text stays coherent.
DEFAULT_RELATIVE_DELTA = 0.2

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"

DELETE = object()  # edit_adapter_config(dir, field=DELETE) removes the field


@cache
def load_base_model(base_model_dir: str) -> torch.nn.Module:
    """The base model in float32, loaded once per directory (str for the cache key)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    model.eval()
    return model


def make_peft_adapter(
    base_model_dir: Path,
    out_dir: Path,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: Sequence[str] | str = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    std: float | None = None,
    base_model: torch.nn.Module | None = None,
    **lora_config_kwargs: Any,
) -> Path:
    """Write a PEFT LoRA adapter for the model in base_model_dir into out_dir.

    std: the normal std of every lora_A / lora_B entry; None scales each module so its
    delta is DEFAULT_RELATIVE_DELTA times its base weight's std. base_model: an already
    loaded model of base_model_dir to use (it is left as it was). Extra keywords go to
    peft.LoraConfig (rank_pattern, alpha_pattern, layers_to_transform, ...).
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    model = base_model if base_model is not None else load_base_model(str(base_model_dir))
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,  # type: ignore[arg-type]  # annotated int, any number works
        target_modules=targets if isinstance(targets, str) else list(targets),
        use_rslora=use_rslora,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
        **lora_config_kwargs,
    )
    # get_peft_model wraps the model's linears in place and freezes its parameters;
    # both are undone below so the caller's (or the cached) model stays as it was.
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    peft_model = get_peft_model(model, config)
    try:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, layer in sorted(peft_model.named_modules(), key=lambda kv: kv[0]):
                if not isinstance(layer, LoraLayer) or "default" not in layer.lora_A:
                    continue
                _draw_factors(layer, generator, std)
        out_dir.mkdir(parents=True, exist_ok=True)
        peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    finally:
        peft_model.unload()
        for name, p in model.named_parameters():
            p.requires_grad_(requires_grad[name])
    return out_dir


def _draw_factors(layer: Any, generator: torch.Generator, std: float | None) -> None:
    lora_a = layer.lora_A["default"].weight  # [r, in]
    lora_b = layer.lora_B["default"].weight  # [out, r]
    rank = lora_a.shape[0]
    if std is None:
        # delta = scaling * B @ A has element std scaling * sqrt(r) * std**2.
        target = DEFAULT_RELATIVE_DELTA * float(layer.get_base_layer().weight.float().std())
        std = math.sqrt(target / (abs(layer.scaling["default"]) * math.sqrt(rank)))
    for param in (lora_a, lora_b):
        draw = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
        param.copy_(draw)


# ---------------------------------------------------------------------------- inspecting


def lora_tensor_name(
    layer: int, module: str, kind: str = "lora_A", arch: type[CausalLM] = LlamaForCausalLM
) -> str:
    """The name PEFT saves a factor under, e.g. ...layers.0.self_attn.q_proj.lora_A.weight."""
    parent = arch.module_parents[module]
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.{kind}.weight"


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((adapter_dir / CONFIG_FILE).read_text())
    return config


def read_adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / WEIGHTS_FILE))


# ---------------------------------------------------------------------------- breaking


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_adapter_config(adapter_dir: Path, **changes: Any) -> Path:
    """Set (or, with the value DELETE, remove) fields of adapter_config.json."""
    config = read_adapter_config(adapter_dir)
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    (adapter_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return adapter_dir


def edit_adapter_tensors(
    adapter_dir: Path,
    changes: Mapping[str, torch.Tensor | None] | None = None,
    *,
    rename: Callable[[str], str] | None = None,
) -> Path:
    """Rewrite adapter_model.safetensors: rename every tensor, then set (None: remove) some."""
    from safetensors.torch import save_file

    tensors = read_adapter_tensors(adapter_dir)
    if rename is not None:
        tensors = {rename(name): t for name, t in tensors.items()}
    for name, tensor in (changes or {}).items():
        if tensor is None:
            tensors.pop(name)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(adapter_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return adapter_dir


def convert_to_pickle(adapter_dir: Path) -> Path:
    """Keep only adapter_model.bin, a torch.save pickle of the same tensors."""
    tensors = read_adapter_tensors(adapter_dir)
    torch.save(tensors, adapter_dir / PICKLE_WEIGHTS_FILE)
    (adapter_dir / WEIGHTS_FILE).unlink()
    return adapter_dir


def truncate_weights(adapter_dir: Path, keep_fraction: float = 0.5) -> Path:
    path = adapter_dir / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    return adapter_dir

"""Phi-3: the Llama computation on checkpoints that store q/k/v and gate/up fused.

The checkpoint's `qkv_proj` and `gate_up_proj` are already the fused matrices the Llama
layers run, and adapters target them as single modules: here a LoRA group is one module.
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.models.base import WeightTarget
from engine.models.config import ArchFields, ModelConfig, ModelLoadError, window_of
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    model_types = ("phi3",)
    architectures: ClassVar[dict[str, str]] = {"Phi3ForCausalLM": "phi3"}
    lora_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv": ("qkv_proj",),
        "o": ("o_proj",),
        "gate_up": ("gate_up_proj",),
        "down": ("down_proj",),
    }
    module_parents: ClassVar[dict[str, str]] = {
        "qkv_proj": "self_attn",
        "o_proj": "self_attn",
        "gate_up_proj": "mlp",
        "down_proj": "mlp",
    }

    @classmethod
    def arch_fields(cls, raw: dict[str, Any], source: str) -> ArchFields:
        factors = [raw.get("partial_rotary_factor")]
        for key in ("rope_scaling", "rope_parameters"):
            value = raw.get(key)
            if isinstance(value, dict):
                factors.append(value.get("partial_rotary_factor"))
        for factor in factors:
            if factor is not None and float(factor) != 1.0:
                raise ModelLoadError(
                    f"{source}: partial_rotary_factor {factor} is not supported (only 1.0)"
                )
        # Phi-3 limits every layer to the window whenever config.json sets one.
        return ArchFields(sliding_window=window_of(raw))

    @classmethod
    def linear_shapes(cls, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        return {
            "qkv_proj": (hid, cfg.q_size + 2 * cfg.kv_size),
            "o_proj": (cfg.q_size, hid),
            "gate_up_proj": (hid, 2 * inter),
            "down_proj": (inter, hid),
        }

    @classmethod
    def rope_rows(cls, module: str, cfg: ModelConfig) -> int:
        return cfg.q_size + cfg.kv_size if module == "qkv_proj" else 0

    def layer_weight_targets(self, p: str, layer: LlamaDecoderLayer) -> dict[str, WeightTarget]:
        attn, mlp = layer.self_attn, layer.mlp
        return {
            p + "self_attn.qkv_proj.weight": WeightTarget(
                attn.qkv_proj.weight, rope_rows=self.rope_rows("qkv_proj", self.config)
            ),
            p + "self_attn.o_proj.weight": WeightTarget(attn.o_proj.weight),
            p + "mlp.gate_up_proj.weight": WeightTarget(mlp.gate_up_proj.weight),
            p + "mlp.down_proj.weight": WeightTarget(mlp.down_proj.weight),
        }

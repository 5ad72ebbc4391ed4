"""Qwen3: the Llama layout plus an RMSNorm over each q and k head before rope.

Heads are `head_dim` wide whatever hidden_size / num_heads is, so config.json must name it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.base import META, WeightTarget
from engine.models.config import ArchFields, ModelConfig, switched_window
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from loraplex_kernels import reference as ref


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        # NOTE: q_norm's weight on every q head's row, then k_norm's on every k head's, so
        # both norms are one normalization and one multiply over the fused q/k heads.
        self.qk_norm_weight = nn.Parameter(
            torch.empty(self.num_heads + self.num_kv_heads, self.head_dim, device=META, dtype=dtype)
        )
        self.norm_eps = config.rms_norm_eps

    def rope_qk(self, qk: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        # [T, H + KVH, D]: normalized per head, scaled by its norm's weight, then rotated.
        normed = F.rms_norm(qk, (self.head_dim,), None, self.norm_eps).mul_(self.qk_norm_weight)
        return ref.apply_rope_interleaved(normed, rope)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_types = ("qwen3",)
    architectures: ClassVar[dict[str, str]] = {"Qwen3ForCausalLM": "qwen3"}
    required_keys = ("head_dim",)
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = Qwen3DecoderLayer

    @classmethod
    def arch_fields(cls, raw: dict[str, Any], source: str) -> ArchFields:
        attention_bias = bool(raw.get("attention_bias", False))
        return ArchFields(
            qkv_bias=attention_bias, o_bias=attention_bias, sliding_window=switched_window(raw)
        )

    @classmethod
    def count_parameters(cls, cfg: ModelConfig) -> int:
        return super().count_parameters(cfg) + cfg.num_layers * 2 * cfg.head_dim

    def layer_weight_targets(self, p: str, layer: LlamaDecoderLayer) -> dict[str, WeightTarget]:
        targets = super().layer_weight_targets(p, layer)
        attn = layer.self_attn
        assert isinstance(attn, Qwen3Attention)
        heads, d = attn.num_heads, attn.head_dim
        # The norm weights are permuted like the q/k rows they scale.
        targets[p + "self_attn.q_norm.weight"] = WeightTarget(
            attn.qk_norm_weight[:heads], rope_rows=d, broadcast=True
        )
        targets[p + "self_attn.k_norm.weight"] = WeightTarget(
            attn.qk_norm_weight[heads:], rope_rows=d, broadcast=True
        )
        return targets

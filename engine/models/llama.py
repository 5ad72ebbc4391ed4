"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a step's flattened tokens.

Hugging Face checkpoints keep q/k/v and gate/up as separate matrices; here each pair or
triple is one fused matrix, so a layer runs two input matmuls instead of five.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, LayerKVCache, paged_attention
from engine.lora.layers import LoRAGroup, LoRASlots
from engine.lora.weights import GROUP_SLICES
from engine.model_loader import ModelConfig, ModelLoadError
from kernels import reference as ref

# Modules are built on the meta device (see LlamaForCausalLM) in the model's dtype.
_META = torch.device("meta")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=_META, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ref.rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Linear(
            config.hidden_size, qkv_size, bias=config.qkv_bias, device=_META, dtype=dtype
        )
        self.o_proj = nn.Linear(
            self.q_size, config.hidden_size, bias=config.o_bias, device=_META, dtype=dtype
        )
        # Set by LlamaForCausalLM.enable_lora.
        self.qkv_lora: LoRAGroup | None = None
        self.o_lora: LoRAGroup | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        lora: ref.LoRASegments | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, Q + 2 KV]
        if lora is not None and self.qkv_lora is not None:
            # NOTE: before rope: the q/k rows of lora_B are rope-interleaved like the base's.
            self.qkv_lora.apply(qkv, x, lora)
        # Rope q and k heads together in one pass: [T, H + KVH, D].
        qk = qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        qk = ref.apply_rope_interleaved(qk, rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, cache, meta, self.scale).reshape(num_tokens, self.q_size)
        y = self.o_proj(out)
        if lora is not None and self.o_lora is not None:
            self.o_lora.apply(y, out, lora)
        return y


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.intermediate_size = inter
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * inter, bias=config.mlp_bias, device=_META, dtype=dtype
        )
        self.down_proj = nn.Linear(
            inter, config.hidden_size, bias=config.mlp_bias, device=_META, dtype=dtype
        )
        self.gate_up_lora: LoRAGroup | None = None
        self.down_lora: LoRAGroup | None = None

    def forward(self, x: torch.Tensor, lora: ref.LoRASegments | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        if lora is not None and self.gate_up_lora is not None:
            self.gate_up_lora.apply(gate_up, x, lora)
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        h = F.silu(gate) * up
        y = self.down_proj(h)
        if lora is not None and self.down_lora is not None:
            self.down_lora.apply(y, h, lora)
        return y


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        lora: ref.LoRASegments | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, meta, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaForCausalLM(nn.Module):
    """Parameters start uninitialized; `load_weights` fills every one of them."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_positions: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        # NOTE: built on the meta device and then materialized empty: random init of
        # every matrix would cost seconds and be overwritten by the checkpoint anyway.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, device=_META, dtype=dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # None: tied to embed_tokens. A CPU transform may install a packed module here.
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(
                config.hidden_size, config.vocab_size, bias=False, device=_META, dtype=dtype
            )
        self.to_empty(device=device)

        num_positions = max_positions or config.max_model_len
        inv_freq = rope_inv_freq_for(config)
        cos, sin = ref.rope_cos_sin(inv_freq, num_positions)  # [P, D/2] float32
        # NOTE: q and k rows are stored with each rotated pair interleaved (see
        # load_weights), so rope is one complex multiply by cos + i sin.
        # Complex64 whatever the model's dtype: half-precision q/k are rotated in float32.
        self.rope: torch.Tensor
        self.register_buffer("rope", torch.complex(cos, sin).to(device=device), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerKVCache],
        lora: ref.LoRASegments | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, HID]. `lora`: which rows
        use which adapter slot (None: no row has an adapter)."""
        assert len(kv_caches) == len(self.layers)
        rope = self.rope[positions].unsqueeze(1)  # [T, 1, D/2] complex, shared by all layers
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, cache, meta, lora)
        return self.norm(x)

    def enable_lora(self, num_slots: int, max_rank: int) -> LoRASlots:
        """Give every fused linear slot buffers for `num_slots` adapters of rank <= max_rank."""
        cfg = self.config
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        inter = cfg.intermediate_size
        shapes = {  # group -> (in_features, slice sizes), slices in GROUP_SLICES order
            "qkv": (cfg.hidden_size, (cfg.q_size, cfg.kv_size, cfg.kv_size)),
            "o": (cfg.q_size, (cfg.hidden_size,)),
            "gate_up": (cfg.hidden_size, (inter, inter)),
            "down": (inter, (cfg.hidden_size,)),
        }
        assert shapes.keys() == GROUP_SLICES.keys()
        groups: list[dict[str, LoRAGroup]] = []
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            by_name = {
                name: LoRAGroup(num_slots, max_rank, fin, sizes, device=device, dtype=dtype)
                for name, (fin, sizes) in shapes.items()
            }
            layer.self_attn.qkv_lora = by_name["qkv"]
            layer.self_attn.o_lora = by_name["o"]
            layer.mlp.gate_up_lora = by_name["gate_up"]
            layer.mlp.down_lora = by_name["down"]
            groups.append(by_name)
        return LoRASlots(groups)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, HID] of the sampling positions only -> float32 logits [S, V]."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; every parameter
        must be covered exactly, else ModelLoadError names what is missing or wrong."""
        targets = self._weight_targets()
        pending = set(targets)
        unexpected: list[str] = []
        with torch.no_grad():
            for name, tensor in weights:
                target = targets.get(name)
                if target is None:
                    if not _ignorable(name, self.config):
                        unexpected.append(name)
                    continue
                param, start, length = target
                dest = param if start is None else param.narrow(0, start, length)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"tensor {name} has shape {list(tensor.shape)}, "
                        f"the config expects {list(dest.shape)}"
                    )
                if _is_rotated(name):
                    tensor = ref.interleave_rope_rows(tensor, self.config.head_dim)
                dest.copy_(tensor)
                pending.discard(name)
        if unexpected:
            raise ModelLoadError(
                f"checkpoint has {len(unexpected)} tensors this architecture does not use, "
                f"e.g. {', '.join(sorted(unexpected)[:5])}"
            )
        if pending:
            raise ModelLoadError(
                f"checkpoint is missing {len(pending)} tensors, "
                f"e.g. {', '.join(sorted(pending)[:5])}"
            )

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, int | None, int]]:
        """HF tensor name -> (parameter, row offset or None for the whole, row count)."""
        cfg = self.config
        targets: dict[str, tuple[torch.Tensor, int | None, int]] = {
            "model.embed_tokens.weight": (self.embed_tokens.weight, None, 0),
            "model.norm.weight": (self.norm.weight, None, 0),
        }
        if self.lm_head is not None:
            assert isinstance(self.lm_head, nn.Linear), "load weights before packing"
            targets["lm_head.weight"] = (self.lm_head.weight, None, 0)
        inter = cfg.intermediate_size
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            targets[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, None, 0)
            targets[p + "post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm.weight,
                None,
                0,
            )
            qkv_parts = [
                ("q", 0, cfg.q_size),
                ("k", cfg.q_size, cfg.kv_size),
                ("v", cfg.q_size + cfg.kv_size, cfg.kv_size),
            ]
            kinds = ["weight"] + (["bias"] if cfg.qkv_bias else [])
            for kind in kinds:
                fused = getattr(attn.qkv_proj, kind)
                for letter, start, length in qkv_parts:
                    targets[f"{p}self_attn.{letter}_proj.{kind}"] = (fused, start, length)
            for kind in ["weight"] + (["bias"] if cfg.o_bias else []):
                targets[f"{p}self_attn.o_proj.{kind}"] = (getattr(attn.o_proj, kind), None, 0)
            for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
                fused = getattr(mlp.gate_up_proj, kind)
                targets[f"{p}mlp.gate_proj.{kind}"] = (fused, 0, inter)
                targets[f"{p}mlp.up_proj.{kind}"] = (fused, inter, inter)
                targets[f"{p}mlp.down_proj.{kind}"] = (getattr(mlp.down_proj, kind), None, 0)
        return targets


def rope_inv_freq_for(config: ModelConfig) -> torch.Tensor:
    scaling = config.rope_scaling
    if scaling is None:
        return ref.rope_inv_freq(config.head_dim, config.rope_theta)
    return ref.rope_inv_freq(
        config.head_dim,
        config.rope_theta,
        rope_type=scaling.rope_type,
        factor=scaling.factor,
        low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings,
    )


def _ignorable(name: str, config: ModelConfig) -> bool:
    # Old checkpoints store rope frequencies; tied checkpoints may still carry lm_head.
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings


def _is_rotated(name: str) -> bool:
    """q and k projections (weights and biases): the rows rope rotates."""
    return ".self_attn.q_proj." in name or ".self_attn.k_proj." in name

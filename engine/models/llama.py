"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a step's flattened tokens.

Hugging Face checkpoints keep q/k/v and gate/up as separate matrices; here each pair or
triple is one fused matrix, so a layer runs two input matmuls instead of five.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.layers import LoRAGroup
from engine.models.attention import AttentionMetadata, LayerKVCache, paged_attention
from engine.models.base import META, CausalLM, WeightTarget
from engine.models.config import ArchFields, ModelConfig, switched_window, window_of
from loraplex_kernels import cpu_ops
from loraplex_kernels import reference as ref


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=META, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1 and cpu_ops.available(x.device, x.dtype):
            return cpu_ops.rms_norm(x, self.weight, self.eps)  # one call, not six ops
        return ref.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x in place (x + residual, bit for bit), then the norm of the sum."""
        if (x.dim() == 2 and x.stride(1) == 1 and residual.is_contiguous()
                and cpu_ops.available(x.device, x.dtype)):
            # NOTE: one pass over the rows instead of an add and a norm (60 fewer ops in a
            # decode step of SmolLM2; in a 2,048-token prefill the adds alone took 13 ms).
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        return ref.rms_norm(residual.add_(x), self.weight, self.eps)


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
            config.hidden_size, qkv_size, bias=config.qkv_bias, device=META, dtype=dtype
        )
        self.o_proj = nn.Linear(
            self.q_size, config.hidden_size, bias=config.o_bias, device=META, dtype=dtype
        )
        # Set by CausalLM.enable_lora.
        self.qkv_lora: LoRAGroup | None = None
        self.o_lora: LoRAGroup | None = None

    def rope_qk(self, qk: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """q and k heads [T, H + KVH, D] -> rotated, in one pass (bf16 on the CPU: in
        place, in one call)."""
        if (qk.dtype == torch.bfloat16 and qk.stride(2) == 1
                and qk.stride(1) == qk.shape[2] and rope.is_contiguous()
                and cpu_ops.available(qk.device, qk.dtype)):
            cpu_ops.rope_in_place(qk, rope)
            return qk
        return ref.apply_rope_interleaved(qk, rope)

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
        qk = qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        qk = self.rope_qk(qk, rope)
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
            config.hidden_size, 2 * inter, bias=config.mlp_bias, device=META, dtype=dtype
        )
        self.down_proj = nn.Linear(
            inter, config.hidden_size, bias=config.mlp_bias, device=META, dtype=dtype
        )
        self.gate_up_lora: LoRAGroup | None = None
        self.down_lora: LoRAGroup | None = None

    def forward(self, x: torch.Tensor, lora: ref.LoRASegments | None = None) -> torch.Tensor:
        adapted = (lora is not None and self.gate_up_lora is not None
                   and self.gate_up_lora.touches(lora))
        # A packed CPU layer may run the SiLU in its own matmul (cpu_linear.PackedLinear);
        # not when an adapter's delta must be added to gate_up before it.
        fused = None if adapted else getattr(self.gate_up_proj, "silu_mul", None)
        h = None if fused is None else fused(x)
        if h is None:
            h = self._silu_mul(x, lora if adapted else None)
        y = self.down_proj(h)
        if lora is not None and self.down_lora is not None:
            self.down_lora.apply(y, h, lora)
        return y

    def _silu_mul(self, x: torch.Tensor, lora: ref.LoRASegments | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        if lora is not None and self.gate_up_lora is not None:
            self.gate_up_lora.apply(gate_up, x, lora)
        if gate_up.stride(1) == 1 and cpu_ops.available(gate_up.device, gate_up.dtype):
            return cpu_ops.silu_mul(gate_up)  # one pass, not two
        inter = self.intermediate_size
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])  # one temporary, not two


class LlamaDecoderLayer(nn.Module):
    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = self.attention_cls(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        lora: ref.LoRASegments | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it is added): each residual add
        is left to the norm that follows it, which does both in one pass (add_forward).
        `residual` None: x is the stream itself (the first layer), else x is the last
        layer's output still to be added to it. The stream is updated in place."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, cache, meta, lora)
        h = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h, lora), residual


class LlamaForCausalLM(CausalLM):
    """Parameters start uninitialized; `load_weights` fills every one of them."""

    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2")
    architectures: ClassVar[dict[str, str]] = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
    }
    lora_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv": ("q_proj", "k_proj", "v_proj"),
        "o": ("o_proj",),
        "gate_up": ("gate_proj", "up_proj"),
        "down": ("down_proj",),
    }
    module_parents: ClassVar[dict[str, str]] = {
        "q_proj": "self_attn",
        "k_proj": "self_attn",
        "v_proj": "self_attn",
        "o_proj": "self_attn",
        "gate_proj": "mlp",
        "up_proj": "mlp",
        "down_proj": "mlp",
    }
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_positions: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        quantized_linears: bool = False,
    ) -> None:
        """quantized_linears: the decoder layers' linear weights are left on the meta
        device (their biases are not): a load that quantizes every one as it arrives
        (load_weights with `quantize`) replaces each layer and never writes its float
        weight, so a GPU never holds the float model, not even empty."""
        super().__init__(config, max_positions=max_positions, device=device, dtype=dtype)
        # NOTE: built on the meta device and then materialized empty: random init of
        # every matrix would cost seconds and be overwritten by the checkpoint anyway.
        # The table given (_weight) skips nn.Embedding's random init, whose meta-device
        # path imports torch._dynamo and with it Triton: ~130 MiB of a CPU server's RSS.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, device=META, dtype=dtype),
        )
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, dtype) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # None: tied to embed_tokens. A CPU transform may install a packed module here.
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(
                config.hidden_size, config.vocab_size, bias=False, device=META, dtype=dtype
            )
        if quantized_linears:
            linears = {id(m) for m in self.layers.modules() if isinstance(m, nn.Linear)}
            for module in self.modules():
                if id(module) not in linears:
                    module.to_empty(device=device, recurse=False)
                elif isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias = nn.Parameter(torch.empty_like(module.bias, device=device))
        else:
            self.to_empty(device=device)

        num_positions = max_positions or config.max_model_len
        inv_freq = rope_inv_freq_for(config)
        cos, sin = ref.rope_cos_sin(inv_freq, num_positions)  # [P, D/2] float32
        # NOTE: q and k rows are stored with each rotated pair interleaved (see
        # weight_targets), so rope is one complex multiply by cos + i sin.
        # Complex64 whatever the model's dtype: half-precision q/k are rotated in float32.
        self.rope: torch.Tensor
        self.register_buffer("rope", torch.complex(cos, sin).to(device=device), persistent=False)

    # ---------------------------------------------------------------- architecture data

    @classmethod
    def arch_fields(cls, raw: dict[str, Any], source: str) -> ArchFields:
        model_type = raw.get("model_type")
        if model_type == "qwen2":
            return ArchFields(qkv_bias=True, sliding_window=switched_window(raw))
        if model_type == "mistral":
            return ArchFields(sliding_window=window_of(raw))
        attention_bias = bool(raw.get("attention_bias", False))
        return ArchFields(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=switched_window(raw),
        )

    @classmethod
    def linear_shapes(cls, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        return {
            "q_proj": (hid, cfg.q_size),
            "k_proj": (hid, cfg.kv_size),
            "v_proj": (hid, cfg.kv_size),
            "o_proj": (cfg.q_size, hid),
            "gate_proj": (hid, inter),
            "up_proj": (hid, inter),
            "down_proj": (inter, hid),
        }

    @classmethod
    def rope_rows(cls, module: str, cfg: ModelConfig) -> int:
        return {"q_proj": cfg.q_size, "k_proj": cfg.kv_size}.get(module, 0)

    @classmethod
    def count_parameters(cls, cfg: ModelConfig) -> int:
        """Embeddings (+ an untied lm_head), per layer the attention and MLP projections
        (+ biases) and two norms, and the final norm."""
        h, inter = cfg.hidden_size, cfg.intermediate_size
        linears = sum(fin * fout for fin, fout in cls.linear_shapes(cfg).values())
        biases = 0
        if cfg.qkv_bias:
            biases += cfg.q_size + 2 * cfg.kv_size
        if cfg.o_bias:
            biases += h
        if cfg.mlp_bias:
            biases += 2 * inter + h
        per_layer = linears + biases + 2 * h
        embeddings = cfg.vocab_size * h
        lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
        return embeddings + lm_head + cfg.num_layers * per_layer + h

    # ---------------------------------------------------------------- model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerKVCache],
        lora: ref.LoRASegments | None = None,
    ) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers)
        rope = self.rope[positions].unsqueeze(1)  # [T, 1, D/2] complex, shared by all layers
        x = self.embed_tokens(input_ids)  # a fresh tensor: the residual stream, in place
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, rope, cache, meta, lora, residual)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)

    def attach_lora(self, layer: int, groups: dict[str, LoRAGroup]) -> None:
        block = self.layers[layer]
        assert isinstance(block, LlamaDecoderLayer)
        block.self_attn.qkv_lora = groups["qkv"]
        block.self_attn.o_lora = groups["o"]
        block.mlp.gate_up_lora = groups["gate_up"]
        block.mlp.down_lora = groups["down"]

    # ---------------------------------------------------------------- weights

    def weight_targets(self) -> dict[str, WeightTarget]:
        targets = {
            "model.embed_tokens.weight": WeightTarget(self.embed_tokens.weight),
            "model.norm.weight": WeightTarget(self.norm.weight),
        }
        if self.lm_head is not None:
            assert isinstance(self.lm_head, nn.Linear), "load weights before packing"
            targets["lm_head.weight"] = WeightTarget(self.lm_head.weight)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            p = f"model.layers.{i}."
            targets[p + "input_layernorm.weight"] = WeightTarget(layer.input_layernorm.weight)
            targets[p + "post_attention_layernorm.weight"] = WeightTarget(
                layer.post_attention_layernorm.weight
            )
            targets.update(self.layer_weight_targets(p, layer))
        return targets

    def layer_weight_targets(self, p: str, layer: LlamaDecoderLayer) -> dict[str, WeightTarget]:
        """One layer's projections, `p` its name prefix ("model.layers.3.")."""
        cfg = self.config
        attn, mlp = layer.self_attn, layer.mlp
        targets: dict[str, WeightTarget] = {}
        qkv_parts = [
            ("q_proj", 0, cfg.q_size),
            ("k_proj", cfg.q_size, cfg.kv_size),
            ("v_proj", cfg.q_size + cfg.kv_size, cfg.kv_size),
        ]
        for kind in ["weight"] + (["bias"] if cfg.qkv_bias else []):
            fused = getattr(attn.qkv_proj, kind)
            for module, start, length in qkv_parts:
                targets[f"{p}self_attn.{module}.{kind}"] = WeightTarget(
                    fused.narrow(0, start, length), rope_rows=self.rope_rows(module, cfg)
                )
        for kind in ["weight"] + (["bias"] if cfg.o_bias else []):
            targets[f"{p}self_attn.o_proj.{kind}"] = WeightTarget(getattr(attn.o_proj, kind))
        inter = cfg.intermediate_size
        for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
            fused = getattr(mlp.gate_up_proj, kind)
            targets[f"{p}mlp.gate_proj.{kind}"] = WeightTarget(fused.narrow(0, 0, inter))
            targets[f"{p}mlp.up_proj.{kind}"] = WeightTarget(fused.narrow(0, inter, inter))
            targets[f"{p}mlp.down_proj.{kind}"] = WeightTarget(getattr(mlp.down_proj, kind))
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

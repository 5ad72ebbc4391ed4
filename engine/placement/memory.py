"""How much device memory one engine worker needs, and how many KV tokens a slice leaves.

A worker holds, for its whole life:
- the base weights in the serving dtype (parameters counted from config.json);
- `max_loras` adapter slots at `max_lora_rank` on every module the architecture lets an
  adapter target, in the serving dtype (the stacked buffers `LoRAGroup` allocates on CUDA);
- a CUDA context reserve (driver context, cuBLAS workspaces, allocator slack);
- activation headroom for one step, see `activation_bytes`;
- the KV cache: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_loader import ModelConfig
from engine.models.registry import model_class_for

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# NOTE: ~0.5 GB of CUDA context on Ampere/Hopper plus cuBLAS/Triton workspaces and the
# caching allocator's fragmentation; 1 GiB keeps a tight plan from failing at load time.
CUDA_CONTEXT_BYTES = 1 * GIB
# Per-token intermediates of a layer step are not all alive at once, but the caching
# allocator keeps freed blocks around; twice their sum is the headroom kept for them.
ACTIVATION_SAFETY_FACTOR = 2
# The sampler holds float32 logits, probabilities and a sorted copy for top-p per sequence.
_LOGIT_COPIES = 3


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}"
        ) from None


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the model, as its architecture counts them (tied weights once)."""
    return model_class_for(cfg).count_parameters(cfg)


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    return 2 * cfg.num_layers * cfg.kv_size * dtype_bytes(dtype)


def adapter_slot_bytes(cfg: ModelConfig, max_loras: int, max_rank: int, dtype: str) -> int:
    """Device buffers for `max_loras` adapters of rank `max_rank` on every target module."""
    # NOTE: the architecture's shape table, as engine.async_engine.max_adapter_bytes uses;
    # that function bounds an adapter's files (float32), this the device slots.
    shapes = model_class_for(cfg).linear_shapes(cfg)
    per_layer = sum(fin + fout for fin, fout in shapes.values())
    return max_loras * max_rank * per_layer * cfg.num_layers * dtype_bytes(dtype)


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """The engine settings that size a worker's memory (see engine.config.EngineConfig)."""

    dtype: str = "bfloat16"
    max_loras: int = 8
    max_lora_rank: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        for name in ("max_loras", "max_lora_rank", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")


def activation_bytes(
    cfg: ModelConfig, shape: WorkerShape, max_num_seqs: int, kv_cache_tokens: int
) -> int:
    """Transient memory of one engine step, bounded from the engine's own code paths:
    - per batched token, the layer intermediates (residual, norm, qkv, attention output,
      o_proj, gate_up, activation, down) and the LoRA shrink outputs, x a safety factor;
    - float32 logits, probabilities and a sorted copy for each sequence that samples;
    - the prefill masks, one bool per (query token, context token) of the step;
    - decode attention gathers the running sequences' K/V of one layer at a time, which is
      at most one layer's share of the KV cache.
    """
    size = dtype_bytes(shape.dtype)
    per_token = (
        4 * cfg.hidden_size + 2 * cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size
    ) * size + len(model_class_for(cfg).linear_shapes(cfg)) * shape.max_lora_rank * 4
    layer_step = ACTIVATION_SAFETY_FACTOR * shape.max_num_batched_tokens * per_token
    logits = _LOGIT_COPIES * max_num_seqs * cfg.vocab_size * 4
    masks = shape.max_num_batched_tokens * cfg.max_model_len
    decode_gather = -(-kv_cache_tokens * kv_bytes_per_token(cfg, shape.dtype) // cfg.num_layers)
    return layer_step + logits + masks + decode_gather


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes of each part of a worker's footprint."""

    weights: int
    adapters: int
    activations: int
    cuda_context: int
    kv_cache: int
    kv_cache_tokens: int

    @property
    def total(self) -> int:
        return self.weights + self.adapters + self.activations + self.cuda_context + self.kv_cache

    def as_gib(self) -> dict[str, float]:
        parts = {
            "weights": self.weights,
            "adapters": self.adapters,
            "activations": self.activations,
            "cuda_context": self.cuda_context,
            "kv_cache": self.kv_cache,
            "total": self.total,
        }
        return {f"{name}_gb": gib(value) for name, value in parts.items()}

    def describe(self) -> str:
        return (
            f"{gib(self.total):.2f} GiB (weights {gib(self.weights):.2f} + KV cache "
            f"{gib(self.kv_cache):.2f} for {self.kv_cache_tokens} tokens + adapters "
            f"{gib(self.adapters):.2f} + activations {gib(self.activations):.2f} + CUDA "
            f"context {gib(self.cuda_context):.2f})"
        )


def gib(num_bytes: int | float) -> float:
    return round(num_bytes / GIB, 2)


class MemoryModel:
    """The footprint of one worker serving `cfg` with `shape`'s settings."""

    def __init__(self, cfg: ModelConfig, shape: WorkerShape) -> None:
        self.cfg = cfg
        self.shape = shape
        self.num_parameters = count_parameters(cfg)
        self.weights = self.num_parameters * dtype_bytes(shape.dtype)
        self.adapters = adapter_slot_bytes(cfg, shape.max_loras, shape.max_lora_rank, shape.dtype)
        self.kv_bytes_per_token = kv_bytes_per_token(cfg, shape.dtype)

    def kv_tokens_for(self, concurrency: int, context: int) -> int:
        """KV tokens for `concurrency` sequences of `context` tokens, in whole blocks."""
        bs = self.shape.block_size
        return concurrency * (-(-context // bs) * bs)

    def breakdown(self, kv_cache_tokens: int, max_num_seqs: int | None = None) -> MemoryBreakdown:
        seqs = max_num_seqs if max_num_seqs is not None else self.shape.max_num_seqs
        return MemoryBreakdown(
            weights=self.weights,
            adapters=self.adapters,
            activations=activation_bytes(self.cfg, self.shape, seqs, kv_cache_tokens),
            cuda_context=CUDA_CONTEXT_BYTES,
            kv_cache=kv_cache_tokens * self.kv_bytes_per_token,
            kv_cache_tokens=kv_cache_tokens,
        )

    def kv_cache_tokens(self, device_bytes: int, max_num_seqs: int | None = None) -> int:
        """The KV cache a device of `device_bytes` holds after everything else, in whole
        blocks; 0 when not even one block fits."""
        fixed = self.breakdown(0, max_num_seqs).total
        # Each cached token also grows the decode gather by 1/num_layers of its bytes.
        per_token = self.kv_bytes_per_token * (1 + 1 / self.cfg.num_layers)
        tokens = int(max(0, device_bytes - fixed) // per_token)
        tokens -= tokens % self.shape.block_size
        # Rounding in activation_bytes may tip the last block over; step back until it fits.
        while tokens > 0 and self.breakdown(tokens, max_num_seqs).total > device_bytes:
            tokens -= self.shape.block_size
        return tokens

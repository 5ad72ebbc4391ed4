"""How much device memory one engine worker needs, and how many KV tokens a slice leaves.

A worker holds, for its whole life:
- the base weights in the serving dtype (parameters counted from config.json), or with
  `--quantization` its decoder linear layers at the scheme's bytes (quantized_linear_bytes:
  the layouts of loraplex_kernels/device_quant.py) and the rest in the serving dtype;
- `max_loras` adapter slots at `max_lora_rank` on every module the architecture lets an
  adapter target, in the serving dtype (the stacked buffers `LoRAGroup` allocates on CUDA);
- a CUDA context reserve (driver context, cuBLAS workspaces, allocator slack);
- activation headroom for one step, see `activation_bytes`;
- the KV cache: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes per token.

The worker may use `gpu_memory_utilization` of the device's total memory for all of it;
`kv_cache_budget` gives the KV cache what is left. The engine calls the same function on
CUDA with the numbers it measures at startup (weights and a profiled largest step, see
ModelRunner), the planner with the estimates below, so the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import DEFAULT_INT4_GROUP_SIZE, QuantizationSpec
from engine.models.loader import ModelConfig
from engine.models.registry import model_class_for
from loraplex_kernels.device_quant import DEQUANTIZE_ELEMENTS

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
# What a GPU worker serves of engine.config.SCHEMES (w8a8 runs on the CPU).
GPU_SCHEMES = ("none", "int8", "int4", "fp8")
# vLLM's default and meaning: the share of the device's total memory the worker may use.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def check_gpu_memory_utilization(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value}")


@dataclass(frozen=True, slots=True)
class KVCacheBudget:
    """How a device's memory limit splits, and the KV cache tokens left for it."""

    limit_bytes: int  # total x gpu_memory_utilization
    weights_bytes: int  # base weights and adapter slots
    activation_bytes: int  # peak transient memory of the largest step
    non_torch_bytes: int  # CUDA context, library workspaces: outside torch's allocator
    kv_bytes_per_token: int
    kv_cache_tokens: int  # whole blocks; 0 when not even one block fits

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_tokens * self.kv_bytes_per_token

    def describe(self) -> str:
        return (
            f"limit {gib(self.limit_bytes):.2f} GiB: weights and adapter slots "
            f"{gib(self.weights_bytes):.2f} + peak activations {gib(self.activation_bytes):.2f}"
            f" + CUDA context {gib(self.non_torch_bytes):.2f} GiB, KV cache "
            f"{gib(self.kv_cache_bytes):.2f} GiB for {self.kv_cache_tokens} tokens"
        )


def kv_cache_budget(
    *,
    total_bytes: int,
    weights_bytes: int,
    activation_bytes: int,
    kv_bytes_per_token: int,
    gpu_memory_utilization: float,
    block_size: int,
    non_torch_bytes: int = 0,
    kv_gather_divisor: int | None = None,
) -> KVCacheBudget:
    """The KV cache tokens that fit under total_bytes x gpu_memory_utilization beside the
    weights, the peak activations and the non-torch memory, in whole blocks.

    kv_gather_divisor: transient memory that grows with the cache, ceil(kv bytes / divisor)
    (decode attention gathers up to one layer's share of the cache: the number of layers);
    a profiling step cannot measure it, so both callers add it here.
    """
    check_gpu_memory_utilization(gpu_memory_utilization)
    assert kv_bytes_per_token > 0 and block_size > 0, (kv_bytes_per_token, block_size)
    limit = int(total_bytes * gpu_memory_utilization)
    left = limit - weights_bytes - activation_bytes - non_torch_bytes

    def cost(tokens: int) -> int:
        kv = tokens * kv_bytes_per_token
        return kv + (-(-kv // kv_gather_divisor) if kv_gather_divisor else 0)

    tokens = 0
    if left > 0:
        d = kv_gather_divisor or 0
        tokens = left * d // (kv_bytes_per_token * (d + 1)) if d else left // kv_bytes_per_token
        while tokens > 0 and cost(tokens) > left:
            tokens -= 1
        tokens -= tokens % block_size
    return KVCacheBudget(
        limit_bytes=limit,
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        non_torch_bytes=non_torch_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_cache_tokens=tokens,
    )


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


def quantized_linear_bytes(in_features: int, out_features: int, scheme: str,
                           group_size: int | None = None) -> int:
    """Bytes of one linear weight as a GPU worker holds it under `scheme`
    (device_quant.py): the integers (fp8 values), and float32 scales (int4: and offsets)
    per output channel and group; group_size as --quantization-group-size (None: per
    channel for int8 and fp8, DEFAULT_INT4_GROUP_SIZE for int4)."""
    weights = in_features * out_features
    group = group_size or (DEFAULT_INT4_GROUP_SIZE if scheme == "int4" else in_features)
    if in_features % group:
        raise ValueError(f"--quantization {scheme}: group size {group} does not divide "
                         f"{in_features} input features")
    if scheme in ("int8", "fp8"):  # fp8: one group, per channel
        return weights + 4 * out_features * (in_features // group)
    if scheme == "int4":
        return weights // 2 + 8 * out_features * (in_features // group)
    raise ValueError(f"a GPU worker does not serve --quantization {scheme} "
                     f"({', '.join(GPU_SCHEMES)})")


def base_weight_bytes(cfg: ModelConfig, dtype: str, quantization: str = "none",
                      group_size: int | None = None) -> int:
    """The base model's weights on a GPU worker: every parameter in `dtype`, or with a
    quantization the decoder linear layers at its bytes and the rest (embeddings, output
    projection, norms) in `dtype`."""
    total = count_parameters(cfg) * dtype_bytes(dtype)
    if quantization == "none":
        return total
    shapes = model_class_for(cfg).linear_shapes(cfg).values()
    dense = sum(fin * fout for fin, fout in shapes) * dtype_bytes(dtype)
    quantized = sum(quantized_linear_bytes(fin, fout, quantization, group_size)
                    for fin, fout in shapes)
    return total - cfg.num_layers * (dense - quantized)


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """The engine settings that size a worker's memory (see engine.config.EngineConfig)."""

    dtype: str = "bfloat16"
    max_loras: int = 8
    max_lora_rank: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    quantization: str = "none"  # one of GPU_SCHEMES
    quantization_group_size: int | None = None

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        if self.quantization not in GPU_SCHEMES:
            raise ValueError(f"a GPU worker does not serve --quantization {self.quantization} "
                             f"({', '.join(GPU_SCHEMES)})")
        QuantizationSpec(self.quantization, self.quantization_group_size)  # the group size
        check_gpu_memory_utilization(self.gpu_memory_utilization)
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
    return layer_step + logits + masks + decode_gather + quantized_step_bytes(cfg, shape)


def quantized_step_bytes(cfg: ModelConfig, shape: WorkerShape) -> int:
    """What a quantized layer adds to a step on a GPU (device_quant.py), for the largest
    fused layer: int8 / int4 steps above the kernel's rows multiply over the layer
    dequantized into the activations' dtype (its float32 temporaries bounded by
    DEQUANTIZE_ELEMENTS); fp8 steps hold the fp8 input rows and their product in float32
    before it is cast."""
    if shape.quantization == "none":
        return 0
    groups = model_class_for(cfg).lora_group_shapes(cfg).values()
    fin, fout = max(((fin, sum(outs)) for fin, outs in groups), key=lambda p: p[0] * p[1])
    tokens = shape.max_num_batched_tokens
    if shape.quantization == "fp8":
        return tokens * fin * (1 + 4) + tokens * fout * (4 + dtype_bytes(shape.dtype))
    # The dequantized layer, one block's float32 values and its unpacked integers.
    return fin * fout * dtype_bytes(shape.dtype) + min(fin * fout, DEQUANTIZE_ELEMENTS) * (4 + 2)


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
        self.weights = base_weight_bytes(cfg, shape.dtype, shape.quantization,
                                         shape.quantization_group_size)
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
        """The KV cache a device of `device_bytes` holds under the worker's
        gpu_memory_utilization after everything else, in whole blocks; 0 when not even one
        block fits."""
        return self.kv_cache_budget(device_bytes, max_num_seqs).kv_cache_tokens

    def kv_cache_budget(self, device_bytes: int, max_num_seqs: int | None = None) -> KVCacheBudget:
        fixed = self.breakdown(0, max_num_seqs)
        return kv_cache_budget(
            total_bytes=device_bytes,
            weights_bytes=fixed.weights + fixed.adapters,
            activation_bytes=fixed.activations,
            non_torch_bytes=fixed.cuda_context,
            kv_bytes_per_token=self.kv_bytes_per_token,
            gpu_memory_utilization=self.shape.gpu_memory_utilization,
            block_size=self.shape.block_size,
            kv_gather_divisor=self.cfg.num_layers,
        )

    def fits(self, need: MemoryBreakdown, device_bytes: int) -> bool:
        """Whether a worker of footprint `need` fits a device of `device_bytes` under the
        utilisation limit."""
        return need.total <= int(device_bytes * self.shape.gpu_memory_utilization)
